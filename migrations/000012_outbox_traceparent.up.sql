-- The W3C trace context of the request that wrote the event, so its delivery
-- and the jobs it triggers continue that request's trace, on any instance.
ALTER TABLE outbox_events ADD COLUMN traceparent text;
