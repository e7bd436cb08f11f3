package main

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"
	"github.com/riverqueue/river"
)

func newTestLifecycle() *Lifecycle {
	return newLifecycle(newLogger(io.Discard, "json"), newMetrics(), time.Now())
}

func TestStateTransitionsMoveForwardOnly(t *testing.T) {
	lc := newTestLifecycle()
	var seen []string
	unregister := lc.OnStateChange(func(from, to State) { seen = append(seen, from.String()+"→"+to.String()) })

	lc.moveTo(StateReady)
	lc.moveTo(StateDraining)
	for _, back := range []State{StateStarting, StateReady, StateDraining} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("draining → %s did not panic", back)
				}
			}()
			lc.moveTo(back)
		}()
	}
	unregister()
	lc.moveTo(StateStopped)

	if want := []string{"starting→ready", "ready→draining"}; !slices.Equal(seen, want) {
		t.Errorf("callbacks saw %v, want %v (none after unregister)", seen, want)
	}
	if lc.State() != StateStopped {
		t.Errorf("state %s", lc.State())
	}
}

func TestStateMayBeSkippedButNotRepeated(t *testing.T) {
	lc := newTestLifecycle()
	lc.advanceTo(StateDraining) // a boot aborted by SIGTERM never was ready
	lc.advanceTo(StateDraining) // a second request is a no-op, not a panic
	if lc.State() != StateDraining {
		t.Fatalf("state %s", lc.State())
	}
}

func TestPhaseFailurePolicies(t *testing.T) {
	lc := newTestLifecycle()
	ctx := context.Background()
	boom := errors.New("boom")

	if err := lc.runPhase(ctx, "config", time.Second, failExit, func(context.Context, *phaseRun) error { return boom }); !errors.Is(err, boom) || !strings.HasPrefix(err.Error(), "config: ") {
		t.Errorf("failExit phase returned %v, want the error prefixed with the phase", err)
	}
	if err := lc.runPhase(ctx, "searchAdapter", time.Second, failWarn, func(context.Context, *phaseRun) error { return boom }); err != nil {
		t.Errorf("failWarn phase ended the boot: %v", err)
	}
	if err := lc.runPhase(ctx, "fileStorage", time.Second, failExit, func(context.Context, *phaseRun) error { return skipPhase("S3_ENDPOINT is not set") }); err != nil {
		t.Errorf("skipped phase ended the boot: %v", err)
	}
	got := lc.Timeline()
	want := []phaseOutcome{outcomeFailed, outcomeWarn, outcomeSkipped}
	for i, rec := range got {
		if rec.Outcome != want[i] {
			t.Errorf("phase %s outcome %s, want %s", rec.Phase, rec.Outcome, want[i])
		}
	}
	if got[2].Note != "S3_ENDPOINT is not set" {
		t.Errorf("skip reason %q", got[2].Note)
	}
}

// A phase that overruns its timeout is aborted even if it ignores its context.
func TestPhaseTimeoutAbortsAPhaseThatIgnoresItsContext(t *testing.T) {
	lc := newTestLifecycle()
	release := make(chan struct{})
	defer close(release)
	start := time.Now()
	err := lc.runPhase(context.Background(), "featureRegister", 50*time.Millisecond, failExit, func(context.Context, *phaseRun) error {
		<-release // ignores ctx
		return nil
	})
	if !errors.Is(err, errPhaseTimeout) || !strings.Contains(err.Error(), "did not finish within 50ms") {
		t.Fatalf("err = %v, want a phase timeout naming the phase's budget", err)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("the boot waited %s for a phase with a 50ms timeout", took)
	}
}

// A warn phase that times out warns; the boot budget running out still fails.
func TestBootBudgetEndsEvenAWarnPhase(t *testing.T) {
	lc := newTestLifecycle()
	ctx, cancel := context.WithTimeoutCause(context.Background(), 30*time.Millisecond, errStartupBudget)
	defer cancel()
	err := lc.runPhase(ctx, "searchAdapter", time.Second, failWarn, func(ctx context.Context, _ *phaseRun) error {
		<-ctx.Done()
		return ctx.Err()
	})
	if !errors.Is(err, errStartupBudget) {
		t.Fatalf("err = %v, want the startup budget", err)
	}
}

func TestConnectBackoffSequence(t *testing.T) {
	var got []time.Duration
	for n := 1; n <= 8; n++ {
		got = append(got, backoffDelay(time.Second, 30*time.Second, n))
	}
	want := []time.Duration{1, 2, 4, 8, 16, 30, 30, 30}
	for i := range want {
		if got[i] != want[i]*time.Second {
			t.Fatalf("backoff sequence %v, want %v s", got, want)
		}
	}
}

func TestShutdownHooksRunLIFOAndASlowHookDoesNotBlockTheRest(t *testing.T) {
	lc := newTestLifecycle()
	var mu sync.Mutex
	var ran []string
	hook := func(c component, fn func(context.Context) error) {
		lc.RegisterShutdownHook(c, func(ctx context.Context) error {
			mu.Lock()
			ran = append(ran, c.String())
			mu.Unlock()
			return fn(ctx)
		})
	}
	release := make(chan struct{})
	defer close(release)
	hook(componentDB, func(context.Context) error { return nil })
	hook(componentRedis, func(context.Context) error { return errors.New("connection reset") })
	hook(componentJobsWorker, func(context.Context) error { <-release; return nil }) // hangs, ignoring ctx
	hook(componentOutboxPoller, func(context.Context) error { return nil })

	ctx, cancel := context.WithTimeout(context.Background(), 400*time.Millisecond)
	defer cancel()
	var steps []string
	start := time.Now()
	err := lc.runShutdownHooks(ctx, time.Second, func(name string, _ time.Duration, _ error, _ goroutineDump) { steps = append(steps, name) })

	if want := []string{"outboxPoller", "jobsWorker", "redis", "db"}; !slices.Equal(ran, want) || !slices.Equal(steps, want) {
		t.Errorf("hooks ran %v (steps logged %v), want %v", ran, steps, want)
	}
	if err == nil || !strings.Contains(err.Error(), "jobsWorker") || !strings.Contains(err.Error(), "redis") {
		t.Errorf("error %v should name both failing hooks", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Errorf("hooks took %s with a 400ms budget", took)
	}
	if lc.runShutdownHooks(ctx, time.Second, func(string, time.Duration, error, goroutineDump) { t.Error("a hook ran twice") }) != nil {
		t.Error("second run returned an error")
	}
}

func TestHookDeadlineKeepsAReserveForLaterHooks(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	d := time.Until(hookDeadline(ctx, time.Second, 3))
	if d < 6*time.Second || d > 7*time.Second+100*time.Millisecond {
		t.Errorf("with 3 hooks after it, a hook gets %s of 10s; want about 7s (1s reserve each)", d)
	}
}

// Job args of the feature-graph test: a job is named by its args type.
type (
	testIndexArgs  struct{}
	testDigestArgs struct{}
	testManualArgs struct{}
)

func (testIndexArgs) Kind() string  { return "indexNote" }
func (testDigestArgs) Kind() string { return "digest" }
func (testManualArgs) Kind() string { return "sleep" }

func TestValidateFeaturesListsEveryProblem(t *testing.T) {
	index := func(workDeps, context.Context, *river.Job[testIndexArgs]) error { return nil }
	digestAt := func(time.Time, int64) testDigestArgs { return testDigestArgs{} }
	err := validateFeatures([]feature{
		{name: "notes", publishes: []string{"note.added"}, workers: []worker{work(index)},
			subscriptions: []subscription{{event: "note.added", kind: "indexNote"}, {event: "note.archived", kind: "indexNote"}},
			crons:         []cronJob{schedule("*/5 * * *", digestAt)}},
		{name: "notes", requires: []setting{{name: "MEILI_URL", present: false}}, uses: []dependency{usesMasterKey}},
		{name: "digests", workers: []worker{work(index)}, routes: []route{{method: "GET", path: "/digests"}},
			manualJobs: []manualJob{byHand(func(echo.Context) (testManualArgs, error) { return testManualArgs{}, nil })}},
	}, false)
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{`feature "notes" is declared by both`, `unknown event "note.archived"`,
		`schedules job "digest", which no feature works`, `run job "sleep", which no feature works`,
		`cron "*/5 * * *"`, "needs MEILI_URL", "notes uses the master key: set KUMIKO_MASTER_KEY", `job "indexNote" is declared by both`, "outside /api/"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in:\n%v", want, err)
		}
	}
}

// A feature's routes and jobs get the connections and services it uses and
// no others; the process's own pieces go to every feature.
func TestFeatureIsGivenOnlyWhatItUses(t *testing.T) {
	db, rdb, key, hub, m := &pgxpool.Pool{}, &redis.Client{}, &masterKey{}, &sseHub{}, newMetrics()
	routes := routeDeps{cfg: config{InstanceID: "i"}, metrics: m, db: db, redis: rdb, masterKey: key, sse: hub}
	got := routes.usedBy(feature{uses: []dependency{usesRedis, usesStreams}})
	if got.redis != rdb || got.sse != hub || got.cfg.InstanceID != "i" || got.metrics != m {
		t.Errorf("a feature that uses Redis and the streams lacks them or the process's own: %v %v %q %v", got.redis, got.sse, got.cfg.InstanceID, got.metrics)
	}
	if got.db != nil || got.masterKey != nil || got.search != nil {
		t.Errorf("a feature that uses Redis and the streams was given more: db %v, master key %v, search %v", got.db, got.masterKey, got.search)
	}
	work := workDeps{call: time.Second, db: db, bucket: "files", masterKey: key}
	if got := work.usedBy(feature{uses: []dependency{usesStorage}}); got != (workDeps{call: time.Second, bucket: "files"}) {
		t.Errorf("the jobs of a feature that uses storage were given %+v", got)
	}
}

// Every deadline comes from the config through newTimeouts: River's soft
// stop gets half of what the release hooks are sure to have, a connect
// attempt never outlasts its window, a request's dependency calls share
// one budget, and River rescues a stranded job right after its timeout.
func TestTimeoutsAreDerivedFromTheConfig(t *testing.T) {
	c := defaultConfig()
	l := &c.Lifecycle
	l.ShutdownTimeout, l.Linger, l.DrainTimeout, l.ConnectMaxWait = 40*time.Second, 3*time.Second, 30*time.Second, 2*time.Second
	c.HTTP.DependencyTimeout, c.DB.StatementTimeout, c.DB.LockTimeout = 400*time.Millisecond, 7*time.Second, 3*time.Second
	got := newTimeouts(c)
	if got.request != 400*time.Millisecond {
		t.Errorf("request = %s, want the configured 400ms", got.request)
	}
	if got.dbStatement != 7*time.Second || got.dbLock != 3*time.Second {
		t.Errorf("dbStatement, dbLock = %s, %s; want the configured 7s and 3s", got.dbStatement, got.dbLock)
	}
	if got.jobsStop != 3500*time.Millisecond {
		t.Errorf("jobsStop = %s, want (40s − 3s − 30s) / 2 = 3.5s", got.jobsStop)
	}
	if got.connectAttempt != 2*time.Second {
		t.Errorf("connectAttempt = %s, want the 2s connect window", got.connectAttempt)
	}
	if want := 2*l.Readiness.CheckInterval + l.Readiness.ProbeTimeout; got.readinessStale != want {
		t.Errorf("readinessStale = %s, want two check intervals and a probe, %s", got.readinessStale, want)
	}
	if want := c.LeaderElection.RenewInterval / 4; got.leaderRenewRetry != want {
		t.Errorf("leaderRenewRetry = %s, want a quarter of the renew interval, %s", got.leaderRenewRetry, want)
	}
	if want := c.Jobs.Timeout + 10*time.Second; got.jobsRescue != want {
		t.Errorf("jobsRescue = %s, want the job timeout and River's 10 s to record a job's outcome, %s", got.jobsRescue, want)
	}
	if got.dbIdleInTx != c.DB.IdleInTransactionTimeout {
		t.Errorf("dbIdleInTx = %s, want the configured %s", got.dbIdleInTx, c.DB.IdleInTransactionTimeout)
	}
	if got.shutdown != l.ShutdownTimeout || got.drain != l.DrainTimeout || got.linger != l.Linger ||
		got.boot != l.StartupTimeout || got.phase != l.PhaseTimeout || got.connect != l.ConnectMaxWait {
		t.Errorf("newTimeouts(%+v) = %+v: a configured deadline was not passed through", l, got)
	}
}
