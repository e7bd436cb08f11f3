DROP TABLE scheduler_fence;
