-- demo:begin (the orders demo; scripts/new-service.sh --bare removes this block)
-- Orders are the demo's business rows; every order writes its order.created
-- event into outbox_events in the same transaction (transactional outbox).
CREATE TABLE orders (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer        text        NOT NULL CHECK (char_length(customer) BETWEEN 1 AND 200),
    items           jsonb       NOT NULL,
    total_cents     bigint      NOT NULL CHECK (total_cents >= 0),
    -- A retried POST with the same Idempotency-Key finds the first order here,
    -- even when the Redis in-flight marker was lost in a crash.
    idempotency_key text        UNIQUE,
    created_at      timestamptz NOT NULL DEFAULT now()
);
-- demo:end

-- A feature writes its events into outbox_events in the same transaction as
-- its business rows (transactional outbox).
CREATE TABLE outbox_events (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type  text        NOT NULL,
    aggregate_id    text        NOT NULL,
    event_type      text        NOT NULL,
    payload         jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error      text,
    delivered_at    timestamptz,  -- set in the transaction that delivered the event
    dead_at         timestamptz   -- set when delivery was given up after the maximum attempts
);

-- The pollers' claim query: due, undelivered, not dead, oldest first.
CREATE INDEX outbox_events_due ON outbox_events (next_attempt_at, id)
    WHERE delivered_at IS NULL AND dead_at IS NULL;
