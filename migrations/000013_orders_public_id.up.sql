-- Orders get an opaque public id for URLs and API answers, so order ids cannot
-- be enumerated; the bigint id stays for joins, jobs and the outbox. Existing
-- rows are backfilled (random UUIDs) and keep working under their new id; new
-- rows get a UUIDv7 from the service. The default covers any writer that does
-- not set one, such as an older binary during a rolling deploy.
ALTER TABLE orders ADD COLUMN public_id uuid;
UPDATE orders SET public_id = gen_random_uuid() WHERE public_id IS NULL;
ALTER TABLE orders ALTER COLUMN public_id SET DEFAULT gen_random_uuid();
ALTER TABLE orders ALTER COLUMN public_id SET NOT NULL;
CREATE UNIQUE INDEX orders_public_id_key ON orders (public_id);
