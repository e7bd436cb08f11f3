-- River's schema migration 003 (river job tags non null), generated from River's bundled migrations by
-- river_schema_test.go (KUMIKO_REGENERATE=1 go test -run TestRiverMigrations .). Do not edit.

ALTER TABLE river_job
    ALTER COLUMN tags DROP NOT NULL,
    ALTER COLUMN tags DROP DEFAULT;
