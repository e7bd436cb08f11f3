-- Partitioned delivery (docs/delivery.md): every instance delivers its share
-- of the outbox at once, and a short sequencer step numbers what they
-- delivered. Schema-wise that needs two indexes and nothing else: the share
-- of an event is computed from its aggregate in the claim query, so adding
-- partitioned delivery rewrites no table.

-- The claim query walks the pending events oldest first. The old index led
-- with next_attempt_at, so the planner walked the primary key instead and
-- skipped every delivered row on each claim: the cost of a batch grew with
-- the delivered history (a 200,000-event backlog: 1,500 events/s).
CREATE INDEX outbox_events_pending ON outbox_events (id)
    WHERE delivered_at IS NULL AND dead_at IS NULL;
DROP INDEX outbox_events_due;

-- The sequencer's work list: delivered, not yet numbered. It is empty most of
-- the time, so the sequencer step costs the same whatever the table holds.
CREATE INDEX outbox_events_unsequenced ON outbox_events (id)
    WHERE delivery_seq IS NULL AND delivered_at IS NOT NULL;
