-- River's schema migration 001 (create river migration), generated from River's bundled migrations by
-- river_schema_test.go (KUMIKO_REGENERATE=1 go test -run TestRiverMigrations .). Do not edit.

CREATE TABLE river_migration(
  id bigserial PRIMARY KEY,
  created_at timestamptz NOT NULL DEFAULT NOW(),
  version bigint NOT NULL,
  CONSTRAINT version CHECK (version >= 1)
);

CREATE UNIQUE INDEX ON river_migration USING btree(version);
