-- order.created events no longer carry the order's public id: the event
-- stream shows payloads to anyone, and the id names the order (see
-- orderCreated in orders.go). Events written before are stripped too, so a
-- replay from Last-Event-ID 0 shows none of them for the rest of their
-- retention. The jobs never read it: they load the order by aggregate_id.
UPDATE outbox_events SET payload = payload - 'id'
WHERE aggregate_type = 'order' AND event_type = 'order.created' AND payload ? 'id';
