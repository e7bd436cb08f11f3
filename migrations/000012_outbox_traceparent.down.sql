ALTER TABLE outbox_events DROP COLUMN traceparent;
