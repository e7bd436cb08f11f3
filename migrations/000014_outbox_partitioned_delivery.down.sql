-- A binary from before partitioned delivery numbers events only as it
-- delivers them: number what was delivered and not yet numbered, under the
-- delivery lock (advisoryLockKey in decimal; scripts/new-service.sh rewrites
-- it), so no stream misses those events after the downgrade.
SELECT pg_advisory_xact_lock(118152090970991);
UPDATE outbox_events o SET delivery_seq = n.seq
FROM (SELECT id, nextval('outbox_delivery_seq') AS seq
      FROM unnest(ARRAY(SELECT id FROM outbox_events WHERE delivered_at IS NOT NULL AND delivery_seq IS NULL ORDER BY id))
           WITH ORDINALITY AS t(id, n) ORDER BY n) n
WHERE o.id = n.id;
DROP INDEX outbox_events_unsequenced;
CREATE INDEX outbox_events_due ON outbox_events (next_attempt_at, id)
    WHERE delivered_at IS NULL AND dead_at IS NULL;
DROP INDEX outbox_events_pending;
