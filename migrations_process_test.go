package main

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/url"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2/client"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A migration is all or nothing (issue 32: SIGTERM or SIGKILL while the
// version climbed left a dirty schema that the next boot refused). Each run
// boots a fresh database with auto-apply through a slowed link (Toxiproxy
// latency: each migration takes some tens of ms), and stops the process at a
// random moment of the climb: 20 runs with
// SIGTERM, 20 with SIGKILL. After each, the schema is clean at whatever
// version last committed, a SIGTERM exits 0 with a line that says where the
// schema stands, and the next `migrate up` — the boot's own path — completes
// with no manual step.
func TestMigrationsAreAllOrNothing(t *testing.T) {
	t.Parallel()
	base := testPostgres(t)
	tp := testToxiproxy(t)
	u, _ := url.Parse(base)
	proxy := proxyTo(t, tp, "pg-migrations", u.Host)
	if _, err := proxy.AddToxic("latency", "latency", "downstream", 1, toxiproxy.Attributes{"latency": 3}); err != nil {
		t.Fatal(err)
	}
	latest := shippedLatest(t)

	for _, sig := range []syscall.Signal{syscall.SIGTERM, syscall.SIGKILL} {
		t.Run(sig.String(), func(t *testing.T) {
			t.Parallel()
			stoppedAt := map[int]int{} // schema version after the stop → runs
			said := ""                 // a SIGTERM's line of phase 9
			for run := range 20 {
				env := fastEnv(t)
				direct := env["DATABASE_URL"]
				env["DATABASE_URL"] = withHost(t, direct, proxy.Listen)
				env["KUMIKO_INSTANCE_ID"] = fmt.Sprintf("migrate-%s-%d", sig, run)
				// The random point: once version k has committed, plus up to
				// about one migration's time.
				k := rand.N(latest)
				p := startProc(t, env)
				p.waitLog(20*time.Second, map[string]any{"phase": "dbConnect"})
				waitFor(t, 20*time.Second, fmt.Sprintf("schema version %d", k), func() bool {
					v, _ := schemaVersion(t, direct)
					return v >= k
				})
				<-time.After(time.Duration(rand.N(40)) * time.Millisecond) // real time: the random point within the next migration
				p.signal(sig)
				code := p.wait(20 * time.Second)

				version, dirty := schemaVersion(t, direct)
				stoppedAt[version]++
				if dirty {
					t.Fatalf("%s run %d: schema version %d is dirty after the stop (exit %d)", sig, run, version, code)
				}
				if sig == syscall.SIGTERM {
					if code != 0 {
						t.Fatalf("SIGTERM run %d: exit %d during the boot, want 0", run, code)
					}
					if version < latest {
						// The boot stopped in phase 9: its line says where the schema stands.
						line := p.waitLog(time.Second, map[string]any{"phase": "migrationsCheck", "outcome": "failed"})
						msg := fmt.Sprint(line["error"])
						if !strings.Contains(msg, "shutdown requested") {
							t.Fatalf("SIGTERM run %d: migrationsCheck failed with %q", run, msg)
						}
						if strings.Contains(msg, "migrations stopped") {
							said = msg
						}
					}
				}

				// The next boot's migrations (phase 9's own up), on the direct
				// link: no manual step.
				pool := sharedPool(t, map[string]string{"DATABASE_URL": direct})
				mg, err := newMigrator(pool, time.Minute)
				if err != nil {
					t.Fatal(err)
				}
				err = mg.up(context.Background())
				mg.Close()
				pool.Close()
				if v, dirty := schemaVersion(t, direct); err != nil || v != latest || dirty {
					t.Fatalf("%s run %d (stopped at version %d): the next up: %v; now at %d, dirty %t", sig, run, version, err, v, dirty)
				}
			}
			t.Logf("%s at a random point of the apply, 20 runs: clean every time; schema version right after the stop → runs: %v", sig, stoppedAt)
			if said != "" {
				t.Logf("a SIGTERM's phase 9 line: %s", said)
			}
		})
	}
}

// The instance waiting on the migration lock while another applies takes
// over when that one is killed or stopped mid-apply: it finds the schema
// clean at the last committed version, applies the rest and becomes ready.
func TestMigrationsWaitingInstanceFinishesTheApply(t *testing.T) {
	t.Parallel()
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			env := fastEnv(t)
			direct := env["DATABASE_URL"]
			latest := shippedLatest(t)
			// The schema at version 2, as an earlier release left it (the
			// outbox's table exists).
			pool := sharedPool(t, env)
			mg, err := newMigrator(pool, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			err = errors.Join(mg.m.Migrate(2), mg.Close())
			if err != nil {
				t.Fatalf("migrating the test database to version 2: %v", err)
			}
			// Hold the apply in a later migration, the first that alters the
			// outbox's table: its ALTER waits for this lock. However fast or
			// slow the machine, the first instance is then mid-apply, with
			// the migrations before it committed, holding the migration lock
			// while the second boots.
			hold, err := pool.Begin(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			defer hold.Rollback(context.Background())
			if _, err := hold.Exec(context.Background(), `LOCK TABLE outbox_events IN ACCESS SHARE MODE`); err != nil {
				t.Fatal(err)
			}
			envA := maps.Clone(env)
			envA["KUMIKO_INSTANCE_ID"] = "applier"
			a := startProc(t, envA)
			waitingOn := func(what, query string) {
				waitFor(t, 20*time.Second, what, func() bool {
					var waiting bool
					pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_stat_activity
						WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE $1)`, query).Scan(&waiting)
					return waiting
				})
			}
			waitingOn("the first instance's apply waiting to alter the outbox", "%ALTER TABLE outbox_events%")
			envB := maps.Clone(env)
			envB["KUMIKO_INSTANCE_ID"] = "waiter"
			b := startProc(t, envB)
			waitingOn("the second instance waiting on the migration lock", "%pg_advisory_lock%")
			a.signal(sig)
			if code := a.wait(20 * time.Second); sig == syscall.SIGTERM && code != 0 {
				t.Fatalf("the first instance exited %d on SIGTERM during its apply, want 0", code)
			}
			stoppedAt, _ := schemaVersion(t, direct) // before the waiting one can go on
			hold.Rollback(context.Background())
			b.waitReady()
			if v, dirty := schemaVersion(t, direct); v != latest || dirty {
				t.Fatalf("after the waiting instance's boot: version %d, dirty %t; want %d clean", v, dirty, latest)
			}
			t.Logf("first instance %s at version %d (of %d); the waiting one applied the rest and is ready", sig, stoppedAt, latest)
		})
	}
}

// A database that an earlier release left dirty is explained, not only
// refused: which version, whether its changes are present (a trial run of
// the migration, rolled back) and the one command that mends it; after that
// command the boot's migrations go on by themselves.
func TestDirtySchemaSaysWhatMendsIt(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	env := fastEnv(t)
	db := env["DATABASE_URL"]
	if out, err := migrateCommand(t, env, db, "up"); err != nil {
		t.Fatalf("migrate up: %v\n%s", err, out)
	}
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	latest := shippedLatest(t)
	// A dirty mark whose changes are present is told apart by a trial run
	// that fails on them; a migration that can safely run twice (one that
	// only strips a field from rows, say) cannot be told apart, and needs not
	// be. So the case is built on the newest migration that cannot run twice.
	present := newestNotRerunnable(t, db)
	if n := stepsAbove(t, present); n > 0 {
		if out, err := migrateCommand(t, env, db, "down", fmt.Sprint(n)); err != nil {
			t.Fatalf("migrate down to %d: %v\n%s", present, err, out)
		}
	}

	// Migration `present` committed, its dirty mark was never cleared.
	conn.Exec(ctx, `UPDATE schema_migrations SET dirty = true`)
	p := startProc(t, env)
	code := p.wait(20 * time.Second)
	msg := fmt.Sprint(p.waitLog(time.Second, map[string]any{"phase": "migrationsCheck", "outcome": "failed"})["error"])
	want := fmt.Sprintf("migrate force %d", present)
	if code != 1 || !strings.Contains(msg, fmt.Sprintf("schema version %d is dirty", present)) || !strings.Contains(msg, "after its changes committed") || !strings.Contains(msg, want) {
		t.Fatalf("dirty with its changes present: exit %d, %q; want exit 1 naming %q", code, msg, want)
	}
	if out, err := migrateCommand(t, env, db, "force", fmt.Sprint(present)); err != nil || !strings.Contains(out, "(dirty false)") {
		t.Fatalf("migrate force %d: %v\n%s", present, err, out)
	}

	// Migration `present` did not commit, its dirty mark did.
	if out, err := migrateCommand(t, env, db, "down", "1"); err != nil {
		t.Fatalf("migrate down 1: %v\n%s", err, out)
	}
	conn.Exec(ctx, `UPDATE schema_migrations SET version = $1, dirty = true`, present)
	p = startProc(t, env)
	code = p.wait(20 * time.Second)
	msg = fmt.Sprint(p.waitLog(time.Second, map[string]any{"phase": "migrationsCheck", "outcome": "failed"})["error"])
	before := shippedBefore(t, present)
	want = fmt.Sprintf("migrate force %d", before)
	if code != 1 || !strings.Contains(msg, "changes are absent") || !strings.Contains(msg, want) {
		t.Fatalf("dirty with its changes absent: exit %d, %q; want exit 1 naming %q", code, msg, want)
	}
	if out, err := migrateCommand(t, env, db, "force", fmt.Sprint(before)); err != nil {
		t.Fatalf("migrate force %d: %v\n%s", before, err, out)
	}
	p = startProc(t, env)
	p.waitReady()
	if v, dirty := schemaVersion(t, db); v != latest || dirty {
		t.Fatalf("after the mend and a boot: version %d dirty %t, want %d clean", v, dirty, latest)
	}
}

// newestNotRerunnable is the newest shipped migration whose trial run fails
// on the fully migrated schema at dbURL: its changes are there to be seen.
func newestNotRerunnable(t *testing.T, dbURL string) int {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	mg, err := newMigrator(pool, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer mg.Close()
	for i := len(mg.versions) - 1; i >= 0; i-- {
		applies, err := mg.tryMigration(ctx, mg.versions[i])
		if err != nil {
			t.Fatal(err)
		}
		if !applies {
			return int(mg.versions[i])
		}
	}
	t.Fatal("every shipped migration applies twice: no dirty case with changes present to build")
	return 0
}

// stepsAbove is how many shipped migrations are newer than version.
func stepsAbove(t *testing.T, version int) int {
	vs, err := embeddedVersions()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, v := range vs {
		if int(v) > version {
			n++
		}
	}
	return n
}

// migrateCommand runs `kumiko-lifecycle-demo migrate args…` against dbURL.
func migrateCommand(t *testing.T, env map[string]string, dbURL string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(testBinary, append([]string{"migrate"}, args...)...)
	cmd.Dir = t.TempDir()
	cmd.Env = []string{"DATABASE_URL=" + dbURL, "REDIS_URL=" + env["REDIS_URL"], "KUMIKO_MASTER_KEY=" + testMasterKey}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// schemaVersion reads golang-migrate's version row: 0 when none.
func schemaVersion(t *testing.T, dbURL string) (int, bool) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var version int
	var dirty bool
	err = conn.QueryRow(ctx, `SELECT version, dirty FROM schema_migrations`).Scan(&version, &dirty)
	if err != nil && !strings.Contains(err.Error(), "does not exist") && err != pgx.ErrNoRows {
		t.Fatal(err)
	}
	return version, dirty
}

func shippedLatest(t *testing.T) int {
	vs, err := embeddedVersions()
	if err != nil {
		t.Fatal(err)
	}
	return int(vs[len(vs)-1])
}

func shippedBefore(t *testing.T, version int) int {
	vs, err := embeddedVersions()
	if err != nil {
		t.Fatal(err)
	}
	before := -1
	for _, v := range vs {
		if int(v) < version {
			before = int(v)
		}
	}
	return before
}
