package main

import (
	"context"
	"fmt"
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
	a := newApp(func(string) string { return "" }, nil, io.Discard)
	a.db = pool
	a.cfg.Lifecycle.Migrations.Mode = mode
	a.cfg.Lifecycle.Migrations.SchemaBaseline = baseline
	return a
}

// shipped is the versions of the migrations this binary embeds, oldest first.
func shipped(t testing.TB, pool *pgxpool.Pool) []uint {
	t.Helper()
	mg, err := newMigrator(pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer mg.Close()
	return mg.versions
}

func TestMigrationModes(t *testing.T) {
	ctx := context.Background()
	pool := testPool(t)
	versions := shipped(t, pool)

	p := &phaseRun{name: "migrationsCheck"}
	err := migrationApp(t, pool, migrationsExitOnPending, 0).migrationsCheck(ctx, p)
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("pending migrations %v", versions)) || !strings.Contains(err.Error(), "migrate up") {
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
	versions := shipped(t, pool)
	latest := versions[len(versions)-1]

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
	if err := migrationApp(t, pool, migrationsAutoApply, latest+1).schemaBaseline(ctx, p); err == nil || !strings.Contains(err.Error(), fmt.Sprintf("older than baseline %d", latest+1)) {
		t.Fatalf("version %d under baseline %d: %v", latest, latest+1, err)
	}
	if _, err := pool.Exec(ctx, "UPDATE schema_migrations SET dirty = true"); err != nil {
		t.Fatal(err)
	}
	if err := migrationApp(t, pool, migrationsAutoApply, 1).schemaBaseline(ctx, p); err == nil || !strings.Contains(err.Error(), "migrate force") {
		t.Fatalf("dirty schema: %v", err)
	}
	// The repair the message names: record the real version, clear the flag.
	if err := mg.force(int(latest)); err != nil {
		t.Fatal(err)
	}
	if st, err := mg.status(); err != nil || st.Dirty || st.Version != latest {
		t.Fatalf("after migrate force %d: %+v %v", latest, st, err)
	}
}

// The migrate command applies, reports and rolls back.
func TestMigrateCommand(t *testing.T) {
	env := map[string]string{"DATABASE_URL": testPostgres(t), "REDIS_URL": "redis://127.0.0.1:1"}
	getenv := func(k string) string { return env[k] }
	versions := shipped(t, testPool(t))
	latest := versions[len(versions)-1]
	var out strings.Builder
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, step := range []struct {
		args []string
		want string
	}{
		{[]string{"status"}, fmt.Sprintf("version 0 (dirty false), binary has %d, pending %v", latest, versions)},
		{[]string{"up"}, fmt.Sprintf("version %d (dirty false), binary has %d, pending []", latest, latest)},
		{[]string{"down", fmt.Sprint(len(versions))}, fmt.Sprintf("version 0 (dirty false), binary has %d, pending %v", latest, versions)},
	} {
		out.Reset()
		if err := run(ctx, append([]string{serviceName, "migrate"}, step.args...), getenv, nil, &out, io.Discard); err != nil {
			t.Fatalf("migrate %v: %v", step.args, err)
		}
		if !strings.Contains(out.String(), step.want) {
			t.Errorf("migrate %v printed %q, want %q", step.args, out.String(), step.want)
		}
	}
}

// The migrator's connections take the phase's wait as their idle-in-transaction
// bound, not the pool's seconds: a migration's transaction pauses while the
// process is starved, and a 2 s bound ended one on a busy machine.
func TestMigratorOutlastsThePoolsIdleInTransactionBound(t *testing.T) {
	base := testPool(t)
	cfg := base.Config() // a copy
	cfg.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = "300"
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	mg, err := newMigrator(pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer mg.Close()
	var idle string
	if err := mg.conns.QueryRow("SHOW idle_in_transaction_session_timeout").Scan(&idle); err != nil {
		t.Fatal(err)
	}
	if idle != "1min" {
		t.Errorf("the migrator's idle_in_transaction_session_timeout is %s, want the phase's wait, 1min", idle)
	}
}
