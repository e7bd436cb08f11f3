package main

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	rtrace "runtime/trace"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/sirupsen/logrus"
)

// boot runs the 16 startup phases in their fixed order. Each phase is the
// method named after it, with its own timeout and failure policy, and logs one
// line when it ends. What a phase acquires, it releases by registering a
// shutdown hook right after the acquisition: the drain runs them newest first,
// so the teardown is this list read from the bottom up. The first failure ends
// the boot; the caller then drains what was acquired. ctx ends when a shutdown
// is requested, which aborts the boot at the phase it is in.
func (a *app) boot(ctx context.Context) error {
	ctx, task := rtrace.NewTask(ctx, "boot") // the flight recorder's trace groups the phases' regions under it
	defer task.End()

	// 1. defaults, overridden by kumiko.config.yaml, overridden by the environment; every problem at once.
	//    It runs before the configured timeouts are known, so on the default phase timeout.
	if err := a.runPhase(ctx, "config", a.timeouts.phase, failExit, a.config); err != nil {
		return err
	}

	// The boot budget counts from process start, phase 1 included. Whichever
	// ends first, a phase's timeout or this budget, ends the boot.
	t := a.timeouts
	ctx, cancel := context.WithDeadlineCause(ctx, a.born.Add(t.boot),
		fmt.Errorf("%w: not ready within KUMIKO_STARTUP_TIMEOUT=%s", errStartupBudget, t.boot))
	defer cancel()

	phases := []struct {
		name    string
		timeout time.Duration
		onFail  onFail
		run     func(context.Context, *phaseRun) error
	}{
		// 2. logs, metrics, traces, and the ops listener, so probes answer during the boot.
		{"observability", t.phase, failExit, a.observability},
		// 3. the master key (secrets.go).
		{"secrets", t.phase, failExit, a.secrets},
		// 4. Go version, GOMAXPROCS/GOMEMLIMIT vs cgroup, tzdata, fd limit (runtime_checks.go).
		{"runtimeChecks", t.phase, failExit, a.runtimeChecks},
		// 5. every feature declares its routes, events, jobs and crons (features.go).
		{"featureRegister", t.phase, failExit, a.featureRegister},
		// 6. the feature graph, every problem at once, before anything connects.
		{"bootValidation", t.phase, failExit, a.bootValidation},
		// 7. the pool, retried with backoff for up to KUMIKO_CONNECT_MAX_WAIT (database.go).
		{"dbConnect", t.connect, failExit, a.dbConnect},
		// 8. refuse a dirty or too-old schema, when KUMIKO_SCHEMA_BASELINE is set (migrations.go).
		{"schemaBaseline", t.phase, failExit, a.schemaBaseline},
		// 9. exit, apply or warn on pending migrations: KUMIKO_MIGRATIONS_MODE (migrations.go).
		{"migrationsCheck", t.phase, failExit, a.migrationsCheck},
		// 10. the Redis client, same backoff as the DB (redis.go), then the heartbeat keys and the dashboard status record.
		{"redisConnect", t.connect, failExit, a.redisConnect},
		// 11. Meilisearch; when down or slow (KUMIKO_OPTIONAL_DEPENDENCY_TIMEOUT), warn and let search fall back (search.go).
		{"searchAdapter", t.optionalPhase, failWarn, a.searchAdapter},
		// 12. the S3 bucket, created when missing; when down or slow, warn and degrade (storage.go).
		{"fileStorage", t.optionalPhase, failWarn, a.fileStorage},
		// 13. the outbox poller, and the jobs client its deliveries insert into (retried 3x).
		{"outboxPoller", t.phase, failExit, a.outboxPoller},
		// 14. River works jobs; the leader election runs the cron scheduler (retried 3x).
		{"jobsWorker", t.phase, failExit, a.jobsWorker},
		// 15. the event stream hub, the API port (a port in use fails here, at once) and the admin routes.
		{"apiListener", t.phase, failExit, a.apiListener},
		// 16. the readiness checks start; once the gating ones pass, state → ready and /health/ready answers 200.
		{"ready", t.phase, failExit, a.ready},
	}
	for _, ph := range phases {
		if err := a.runPhase(ctx, ph.name, ph.timeout, ph.onFail, ph.run); err != nil {
			return err
		}
	}
	a.becomeReady()
	return nil
}

// runPhase runs one phase labelled phase=<name> and watched while it runs: a
// phase that times out leaves the diagnostics of where it was stuck.
func (a *app) runPhase(ctx context.Context, name string, timeout time.Duration, policy onFail, run func(context.Context, *phaseRun) error) error {
	stopWatch := watchGoroutines(ctx)
	err := a.lc.runPhase(ctx, name, timeout, policy, func(ctx context.Context, p *phaseRun) (err error) {
		labelled(ctx, labelPhase, name, func() { err = run(ctx, p) })
		return err
	})
	stuck := stopWatch()
	if errors.Is(err, errPhaseTimeout) || errors.Is(err, errStartupBudget) {
		reason := err.Error()
		if where := stuck.blocked(labelPhase, name); where != "" {
			reason += ", " + where
		}
		a.diag.record(ctx, name, reason, stuck)
	}
	return err
}

// config is phase 1. The final log format and the secret scrubbing apply
// before the phase's own log line, so even that line is in the right shape.
func (a *app) config(ctx context.Context, p *phaseRun) error {
	cfg, err := loadConfig(a.getenv, a.environ, os.ReadFile)
	if err != nil {
		return err
	}
	a.cfg = cfg
	a.timeouts = newTimeouts(cfg)
	setLogFormat(a.log, cfg.LogFormat)
	a.log.AddHook(redactHook{secrets: append(cfg.secrets(), otlpSecrets(a.getenv)...)})
	a.log.AddHook(instanceHook{id: cfg.InstanceID})
	for _, g := range cfg.logGroups() {
		a.log.WithFields(logrus.Fields{"component": "config", "group": g.name}).WithFields(g.fields).Info("config")
	}
	for _, d := range cfg.deprecated {
		a.log.WithFields(logrus.Fields{"component": "config", "file": d.file, "line": d.line, "key": d.key, "use": d.use}).
			Warn("deprecated config key")
	}
	for _, u := range cfg.unknownEnv { // KUMIKO_UNKNOWN_ENV=warn
		a.log.WithFields(logrus.Fields{"component": "config", "name": u.name, "closest": u.closest}).
			Warn("environment variable read by no setting")
	}
	return nil
}

// observability is phase 2. Tracing that cannot be set up is a warning (the
// noop provider takes over); an ops port that cannot be bound is not, because
// an orchestrator without probes cannot manage the process.
func (a *app) observability(ctx context.Context, p *phaseRun) error {
	t, traceErr := setupTracing(ctx, a.getenv, a.cfg.InstanceID, version)
	a.tracing = t
	a.lc.traceWith(t.tracer)
	// The flight recorder, from here until the exit line.
	diag, diagErr := startDiagnostics(a.cfg.Diagnostics, a.cfg.InstanceID, a.log)
	a.diag = diag
	if err := errors.Join(traceErr, diagErr); err != nil {
		p.warn(strings.ReplaceAll(err.Error(), "\n", "; "))
	}

	a.health = newReadiness(a.lc, a.metrics, a.timeouts.readinessProbe, a.cfg.Lifecycle.Readiness.CheckInterval,
		a.timeouts.readinessStale, a.panicked)
	a.health.RegisterReadinessCheck("observability", false, func(context.Context) checkResult {
		detail := map[string]any{"provider": t.provider}
		if traceErr != nil {
			detail["error"] = traceErr.Error()
		}
		return okResult(detail)
	})

	e := newEcho(a.log, a.metrics, componentOps)
	addOpsRoutes(e, a.health, a.metrics, a.cfg.HTTP, a.cfg.AdminToken)
	// The admin tree shows the boot timeline from now on; its other routes
	// need Redis and the jobs client, and join in phase 15.
	a.admin = &adminTree{}
	a.admin.mount(newEcho(a.log, a.metrics, componentOps), a.cfg.AdminToken, a.timeouts.request, a.lc, a.diag, adminStarting)
	mux := http.NewServeMux()
	mux.Handle("/", e)
	mux.Handle("/admin/", a.admin)
	ops, err := listenHTTP(ctx, componentOps, a.cfg.OpsAddr, mux, a.cfg.HTTP, connCap{}, a.log, a.serverFailed)
	if err != nil {
		return err
	}
	a.ops = ops
	return nil
}

// instanceHook stamps every log line with the service and the instance id,
// so the logs of two instances, or of two services, can be told apart after
// they are merged.
type instanceHook struct{ id string }

func (instanceHook) Levels() []logrus.Level { return logrus.AllLevels }
func (h instanceHook) Fire(e *logrus.Entry) error {
	e.Data["service"] = serviceName
	e.Data["instance"] = h.id
	return nil
}

// featureRegister is phase 5: every feature declares what it brings.
func (a *app) featureRegister(ctx context.Context, p *phaseRun) error {
	a.features = registerFeatures(a.cfg)
	for _, f := range a.features {
		for _, c := range f.collectors {
			if err := a.metrics.registry.Register(c); err != nil {
				return fmt.Errorf("registering the metrics of feature %s: %w", f.name, err)
			}
		}
	}
	a.blocks.jobs.initKinds(workerKinds(a.features))
	p.note = fmt.Sprintf("%d features", len(a.features))
	return nil
}

// bootValidation is phase 6.
func (a *app) bootValidation(ctx context.Context, p *phaseRun) error {
	return validateFeatures(a.features, a.masterKey != nil)
}

// redisConnect is phase 10: the Redis client, then what this instance keeps
// in Redis: its dashboard record and its workers' heartbeat keys.
func (a *app) redisConnect(ctx context.Context, p *phaseRun) error {
	if err := a.redisClient(ctx, p); err != nil {
		return err
	}
	// The dashboard's status record; its hook runs after the heartbeats' and before the client's.
	a.status = newStatusPublisher(a.redis, a.cfg.InstanceID, a.lc, a.blocks.statusFigures(a.metrics.httpRequests), a.log, a.panicked)
	if err := a.status.Start(ctx); err != nil {
		return err
	}
	// Both cleanups are best effort, each bounded on its own: the record and
	// the heartbeat keys expire by themselves when Redis does not answer.
	a.lc.RegisterShutdownHook(componentClusterStatus, bestEffort(within(a.timeouts.redisRelease, a.status.Stop)))
	// Heartbeat keys live in Redis. Their hook is registered after the client's,
	// so LIFO deletes them after the workers stop and before the client closes.
	a.heartbeats = newHeartbeats(a.redis, a.cfg.InstanceID, a.cfg.Heartbeat.TTL, a.timeouts.backgroundCall, a.blocks.heartbeat, a.health)
	a.lc.RegisterShutdownHook(componentHeartbeats, bestEffort(within(a.timeouts.redisRelease, a.heartbeats.clear)))
	return nil
}

// outboxPoller is phase 13. The River client is created first, not yet
// started, because delivering an event inserts the jobs it triggers; its stop
// hook is registered before the poller's, so the drain stops the poller
// first and the jobs worker after it. Three tries: the framework's guarantees
// need a working poller; then the boot ends.
func (a *app) outboxPoller(ctx context.Context, p *phaseRun) error {
	log := componentJobsWorker.log(a.log)
	riverPool := func(conns int32) (*pgxpool.Pool, error) { return a.newPool(ctx, "river", conns) }
	j, err := newJobs(jobsDeps{cfg: a.cfg.Jobs, newPool: riverPool, rescue: a.timeouts.jobsRescue, instanceID: a.cfg.InstanceID,
		features: a.features, tracer: a.tracing.tracer, metrics: a.blocks.jobs, log: log,
		work: workDeps{log: log, call: a.timeouts.jobCall,
			db: a.db, search: a.search, storage: a.storage, bucket: a.cfg.Storage.Bucket, masterKey: a.masterKey}})
	if err != nil {
		return err
	}
	a.jobs = j
	// A soft stop, then a hard one: half of the step's slice each (jobs.Stop).
	a.lc.RegisterShutdownHook(componentJobsWorker, within(a.timeouts.jobsStop+a.timeouts.hookReserve, j.Stop))

	beat := a.heartbeats.RegisterHeartbeat(componentOutboxPoller)
	poller := newOutboxPoller(outboxPollerDeps{db: a.db, redis: a.redis, cfg: a.cfg.Outbox, beat: beat,
		beatEvery: a.cfg.Heartbeat.Interval, instanceID: a.cfg.InstanceID,
		memberTTL: a.cfg.Heartbeat.TTL, redisCall: a.timeouts.backgroundCall, insertJobs: insertTriggeredJobs(j), log: a.log, metrics: a.blocks.outbox, onPanic: a.panicked})
	if err := a.retry(ctx, p, componentOutboxPoller, 3, poller.Start); err != nil {
		return err
	}
	// The batch in hand finishes, then the poller leaves the pollers (a Redis
	// release). A beat's Redis call in flight when the stop began is waited
	// out too: go-redis ends a call at its deadline, not at a cancel.
	a.lc.RegisterShutdownHook(componentOutboxPoller, within(a.timeouts.batchFinish+2*a.timeouts.redisRelease, poller.stopLosingNothing))
	a.lc.OnStateChange(recordStateChanges(a.db, a.cfg.InstanceID, a.timeouts.stateRecord, a.log.WithField("component", "events")))
	return nil
}

// jobsWorker is phase 14: River starts working jobs, its heartbeat starts,
// and the leader election starts the cron scheduler on whichever instance
// leads. Three tries each, then the boot ends.
func (a *app) jobsWorker(ctx context.Context, p *phaseRun) error {
	if err := a.retry(ctx, p, componentJobsWorker, 3, a.jobs.Start); err != nil {
		return err
	}
	jobsBeat := newBeatLoop(componentJobsHeartbeat, a.heartbeats.RegisterHeartbeat(componentJobsWorker),
		a.cfg.Heartbeat.Interval, a.log, a.panicked)
	if err := jobsBeat.Start(ctx); err != nil {
		return err
	}
	a.lc.RegisterShutdownHook(componentJobsHeartbeat, jobsBeat.Stop)
	backlog := newBacklogWatch(backlogWatchDeps{db: a.db, bound: a.cfg.Backlog.Max, interval: a.cfg.Heartbeat.Interval,
		call: a.timeouts.backgroundCall, metrics: a.blocks.backlog, log: a.log, onPanic: a.panicked})
	if err := backlog.Start(ctx); err != nil {
		return err
	}
	a.backlog = backlog
	a.lc.RegisterShutdownHook(componentJobsBacklog, backlog.Stop)

	le := a.cfg.LeaderElection
	if !le.Enabled {
		a.health.RegisterSkipped("schedulerLeader", "KUMIKO_LEADER_ENABLED=false: this instance schedules no cron jobs")
		return nil
	}
	sched := &scheduler{db: a.db, jobs: a.jobs, crons: cronsOf(a.features),
		beat: a.heartbeats.RegisterHeartbeat(componentScheduler), beatInt: a.cfg.Heartbeat.Interval,
		skipped: a.blocks.cron.ticksSkipped, onPanic: a.panicked, log: componentScheduler.log(a.log)}
	el := newElector(electorDeps{redis: a.redis, redisOpts: a.redisOpts, instanceID: a.cfg.InstanceID, ttl: le.LockTTL, renew: le.RenewInterval,
		timeouts: a.timeouts, lead: sched.lead, fence: sched.fence, log: a.log, metrics: a.blocks.leader, onPanic: a.panicked})
	if err := a.retry(ctx, p, componentLeaderElection, 3, el.Start); err != nil {
		return err
	}
	a.lc.RegisterShutdownHook(componentLeaderElection, el.Stop)
	a.health.RegisterReadinessCheck("schedulerLeader", false, el.readinessCheck)
	return nil
}

// apiListener is phase 15: the event stream hub, then the socket, bound here
// so that "address in use" ends the boot at once instead of surfacing later in
// a goroutine. The ops port gets the admin routes that need Redis and the jobs
// client, which exist from here on.
func (a *app) apiListener(ctx context.Context, p *phaseRun) error {
	hub := newSSEHub(sseHubDeps{db: a.db, redis: a.redis, cfg: a.cfg.SSE, poll: a.cfg.Outbox.PollInterval,
		log: a.log, metrics: a.blocks.sse, onPanic: a.panicked})
	if err := hub.Start(ctx); err != nil {
		return err
	}
	a.sse = hub
	a.lc.RegisterShutdownHook(componentSSEHub, hub.Stop)
	a.lc.OnCloseStreams(hub.goodbyes(a.timeouts, a.diag, a.log))

	e := newEcho(a.log, a.metrics, componentAPI)
	e.IPExtractor = clientIPExtractor(a.cfg.HTTP.TrustedProxies)
	deps := routeDeps{cfg: a.cfg, timeouts: a.timeouts, lc: a.lc, metrics: a.metrics, log: a.log,
		db: a.db, redis: a.redis, search: a.search, masterKey: a.masterKey, sse: hub, jobs: a.jobs}
	a.admission = newAdmission(a.cfg.HTTP, a.metrics)
	around := []echo.MiddlewareFunc{a.backlog.sayWhenDelayed()}
	addAPIRoutes(e, a.lc, a.health, a.features, deps, a.cfg.HTTP, a.admission, around, &a.inFlight, &a.rejecting, a.tracing.tracer)
	a.metrics.apiConnsMax.Set(float64(a.cfg.HTTP.MaxConns))
	api, err := listenHTTP(ctx, componentAPI, a.cfg.HTTPAddr, closeAfterDraining(a.lc, e), a.cfg.HTTP,
		apiConnCap(a.cfg.HTTP, a.metrics), a.log, a.serverFailed)
	if err != nil {
		return err
	}
	a.api = api
	api.registerConnectionsCheck(a.health)

	a.admin.mount(newEcho(a.log, a.metrics, componentOps), a.cfg.AdminToken, a.timeouts.request, a.lc, a.diag,
		adminRoutes(a.features, deps))
	return nil
}

// ready is phase 16: the readiness checks start their background loops, and
// the first 200 waits for a real result of every gating check, so readiness
// never claims what PostgreSQL and the workers cannot back. An optional
// dependency that hangs holds nothing back: its result comes when it comes.
func (a *app) ready(ctx context.Context, p *phaseRun) error {
	if err := a.health.Start(ctx); err != nil {
		return err
	}
	a.lc.RegisterShutdownHook(componentReadinessChecks, a.health.Stop)
	if err := a.health.WaitFirstResults(ctx); err != nil {
		return err
	}
	return a.health.WaitGatesPass(ctx, a.cfg.Lifecycle.Readiness.CheckInterval)
}

// becomeReady ends the boot: state → ready, and the one line an operator
// reads first ("boot took 4.2s, of which 3.1s dbConnect").
func (a *app) becomeReady() {
	// The gauge is set before the state moves: once readiness can answer 200,
	// a scrape must already see how long the boot took.
	took := time.Since(a.born)
	a.metrics.startupDuration.Set(took.Seconds())
	a.lc.moveTo(StateReady)
	slowest := a.lc.slowestPhase()
	a.log.WithFields(logrus.Fields{"component": "lifecycle", "event": "boot_complete", "duration_ms": took.Milliseconds(),
		"slowest_phase": slowest.Phase, "slowest_ms": slowest.DurationMs}).Info("lifecycle")
}
