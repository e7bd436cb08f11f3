-- River's schema migration 008 (job id autoincrement), generated from River's bundled migrations by
-- river_schema_test.go (KUMIKO_REGENERATE=1 go test -run TestRiverMigrations .). Do not edit.

-- No-op. Postgres sequences already prevent automatically generated job IDs
-- from being reused.
SELECT 1;

INSERT INTO river_migration (line, version) VALUES ('main', 1), ('main', 2), ('main', 3), ('main', 4), ('main', 5), ('main', 6), ('main', 7), ('main', 8);
