-- Partitioned delivery (docs/delivery.md): every instance delivers its share
-- of the outbox at once, and a short sequencer step numbers what they
-- delivered. Schema-wise that needs two indexes and nothing else: the share
-- of an event is computed from its aggregate in the claim query, so adding
-- partitioned delivery rewrites no table.

-- The claim reads each partition's pending events oldest first: this index
-- gives it exactly that, whatever the statistics say. The expression is
-- outboxPartitionExpr in outbox_share.go, to the character (the planner
-- matches it as text). The old index led with next_attempt_at, so the
-- planner walked the primary key and skipped every delivered row on each
-- claim: the cost of a batch grew with the delivered history (a
-- 200,000-event backlog: 1,500 events/s); and an index on id alone is
-- ignored when the statistics still say nothing is pending (a fresh table,
-- or a sudden backlog in a large one), for a sort of every pending row per
-- batch.
CREATE INDEX outbox_events_pending ON outbox_events (((hashtext(aggregate_type || '/' || aggregate_id) & 2147483647) % 32), id)
    WHERE delivered_at IS NULL AND dead_at IS NULL;
DROP INDEX outbox_events_due;

-- The sequencer's work list: delivered, not yet numbered. It is empty most of
-- the time, so the sequencer step costs the same whatever the table holds.
CREATE INDEX outbox_events_unsequenced ON outbox_events (id)
    WHERE delivery_seq IS NULL AND delivered_at IS NOT NULL;
