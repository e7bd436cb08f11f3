package main

import (
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

func testPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), testPostgres(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// migrationApp is just enough app for phases 8 and 9.
func migrationApp(t testing.TB, pool *pgxpool.Pool, mode string, baseline uint) *app {
	a := newApp(func(string) string { return "" }, io.Discard)
	a.db = pool
	a.cfg.Lifecycle.Migrations.Mode = mode
	a.cfg.Lifecycle.Migrations.SchemaBaseline = baseline
	return a
}

func TestMigrationModes(t *testing.T) {
	ctx := context.Background()
	pool := testPool(t)

	p := &phaseRun{name: "migrationsCheck"}
	err := migrationApp(t, pool, migrationsExitOnPending, 0).migrationsCheck(ctx, p)
	if err == nil || !strings.Contains(err.Error(), "pending migrations [1 2 3 4 5 6 7 8 9 10 11 12 13]") || !strings.Contains(err.Error(), "migrate up") {
		t.Fatalf("exit-on-pending: %v", err)
	}
	p = &phaseRun{name: "migrationsCheck"}
	if err := migrationApp(t, pool, migrationsWarnOnPending, 0).migrationsCheck(ctx, p); err != nil || !p.warned {
		t.Fatalf("warn-on-pending: err %v, warned %v", err, p.warned)
	}
	p = &phaseRun{name: "migrationsCheck"}
	if err := migrationApp(t, pool, migrationsAutoApply, 0).migrationsCheck(ctx, p); err != nil {
		t.Fatalf("auto-apply: %v", err)
	}
	var n int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM outbox_events").Scan(&n); err != nil {
		t.Fatalf("outbox_events after auto-apply: %v", err)
	}
	p = &phaseRun{name: "migrationsCheck"}
	if err := migrationApp(t, pool, migrationsExitOnPending, 0).migrationsCheck(ctx, p); err != nil {
		t.Fatalf("exit-on-pending with nothing pending: %v", err)
	}
}

// Two instances auto-applying at the same moment: the advisory lock
// serialises them and both boot.
func TestConcurrentAutoApplyIsSafe(t *testing.T) {
	url := testPostgres(t)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Go(func() {
			pool, err := pgxpool.New(context.Background(), url)
			if err != nil {
				errs[i] = err
				return
			}
			defer pool.Close()
			errs[i] = migrationApp(t, pool, migrationsAutoApply, 0).migrationsCheck(context.Background(), &phaseRun{})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("instance %d: %v", i, err)
		}
	}
}

func TestSchemaBaseline(t *testing.T) {
	ctx := context.Background()
	pool := testPool(t)

	p := &phaseRun{}
	if err := migrationApp(t, pool, migrationsAutoApply, 0).schemaBaseline(ctx, p); err == nil || !strings.Contains(err.Error(), "skipped") {
		t.Fatalf("baseline unset must skip, got %v", err)
	}
	if err := migrationApp(t, pool, migrationsAutoApply, 1).schemaBaseline(ctx, p); err != nil {
		t.Fatalf("fresh database must be left to phase 9: %v", err)
	}
	mg, err := newMigrator(pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer mg.Close()
	if err := mg.up(ctx); err != nil {
		t.Fatal(err)
	}
	if err := migrationApp(t, pool, migrationsAutoApply, 14).schemaBaseline(ctx, p); err == nil || !strings.Contains(err.Error(), "older than baseline 14") {
		t.Fatalf("version 13 under baseline 14: %v", err)
	}
	if _, err := pool.Exec(ctx, "UPDATE schema_migrations SET dirty = true"); err != nil {
		t.Fatal(err)
	}
	if err := migrationApp(t, pool, migrationsAutoApply, 1).schemaBaseline(ctx, p); err == nil || !strings.Contains(err.Error(), "migrate force") {
		t.Fatalf("dirty schema: %v", err)
	}
	// The repair the message names: record the real version, clear the flag.
	if err := mg.force(13); err != nil {
		t.Fatal(err)
	}
	if st, err := mg.status(); err != nil || st.Dirty || st.Version != 13 {
		t.Fatalf("after migrate force 13: %+v %v", st, err)
	}
}

// The migrate command applies, reports and rolls back.
func TestMigrateCommand(t *testing.T) {
	env := map[string]string{"DATABASE_URL": testPostgres(t), "REDIS_URL": "redis://127.0.0.1:1"}
	getenv := func(k string) string { return env[k] }
	var out strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, step := range []struct {
		args []string
		want string
	}{
		{[]string{"status"}, "version 0 (dirty false), binary has 13, pending [1 2 3 4 5 6 7 8 9 10 11 12 13]"},
		{[]string{"up"}, "version 13 (dirty false), binary has 13, pending []"},
		{[]string{"down", "13"}, "version 0 (dirty false), binary has 13, pending [1 2 3 4 5 6 7 8 9 10 11 12 13]"},
	} {
		out.Reset()
		if err := run(ctx, append([]string{serviceName, "migrate"}, step.args...), getenv, &out, io.Discard); err != nil {
			t.Fatalf("migrate %v: %v", step.args, err)
		}
		if !strings.Contains(out.String(), step.want) {
			t.Errorf("migrate %v printed %q, want %q", step.args, out.String(), step.want)
		}
	}
}
