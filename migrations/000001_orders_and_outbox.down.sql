DROP TABLE outbox_events;
DROP TABLE orders;
