-- demo:begin
ALTER TABLE orders DROP COLUMN request_hash;
-- demo:end
DROP TRIGGER outbox_events_notify ON outbox_events;
DROP FUNCTION outbox_events_notify();
ALTER TABLE outbox_events DROP COLUMN delivery_seq;
DROP SEQUENCE outbox_delivery_seq;
