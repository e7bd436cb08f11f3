DROP INDEX IF EXISTS orders_public_id_key;
ALTER TABLE orders DROP COLUMN public_id;
