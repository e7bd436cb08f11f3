-- delivery_seq numbers delivered events in the order their delivery committed.
-- Outbox ids are taken at insert and commit out of order, so an SSE client
-- resuming "after id N" could miss an event that committed late; resuming
-- "after the delivery of N" cannot. Pollers draw it from the sequence while
-- holding a transaction-scoped advisory lock, which makes sequence order
-- commit order; a delivery that rolls back burns its numbers, never reuses them.
CREATE SEQUENCE outbox_delivery_seq;
ALTER TABLE outbox_events ADD COLUMN delivery_seq bigint UNIQUE;

-- A poller sleeps until an event is written: the insert wakes it (LISTEN
-- outbox_events), a slow poll remains as the fallback. One notification per
-- statement, sent when the inserting transaction commits.
CREATE FUNCTION outbox_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_events', '');
    RETURN NULL;
END $$;

CREATE TRIGGER outbox_events_notify AFTER INSERT ON outbox_events
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_events_notify();

-- demo:begin (the orders demo; scripts/new-service.sh --bare removes this block)
-- The fingerprint of the request that created an order with an Idempotency-Key,
-- so a key reused for a different request is refused instead of answered
-- with an unrelated order.
ALTER TABLE orders ADD COLUMN request_hash text;
-- demo:end
