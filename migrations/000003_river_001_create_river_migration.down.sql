-- River's schema migration 001 (create river migration), generated from River's bundled migrations by
-- river_schema_test.go (KUMIKO_REGENERATE=1 go test -run TestRiverMigrations .). Do not edit.

DROP TABLE river_migration;
