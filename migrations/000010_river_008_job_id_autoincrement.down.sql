-- River's schema migration 008 (job id autoincrement), generated from River's bundled migrations by
-- river_schema_test.go (KUMIKO_REGENERATE=1 go test -run TestRiverMigrations .). Do not edit.

DELETE FROM river_migration WHERE line = 'main' AND version <= 8;
-- No-op. Postgres sequences already prevent automatically generated job IDs
-- from being reused.
SELECT 1;
