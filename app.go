package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime/debug"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/meilisearch/meilisearch-go"
	"github.com/minio/minio-go/v7"
	"github.com/redis/go-redis/v9"
	"github.com/robfig/cron/v3"
	"github.com/sirupsen/logrus"
)

const serviceName = "kumiko-lifecycle-demo"

// version is set at build time: go build -ldflags "-X main.version=v1.2.3".
var version = "dev"

// app is one process: what the boot acquired, in the order it acquired it.
// Every field below the first block is set by exactly one phase.
type app struct {
	getenv  func(string) string
	born    time.Time
	log     *logrus.Logger
	metrics *metrics
	lc      *Lifecycle
	bus     *eventBus
	stop    *stopper

	cfg        config        // 1. config
	tracing    tracing       // 2. observability
	health     *readiness    // 2. observability
	ops        *httpServer   // 2. observability
	masterKey  *masterKey    // 3. secrets
	features   []feature     // 5. featureRegister
	db         *pgxpool.Pool // 7. dbConnect
	redis      *redis.Client // 10. redisConnect
	heartbeats *heartbeats   // 10. redisConnect
	search     meilisearch.ServiceManager
	storage    *minio.Client
	jobs       *jobs // 13. outboxPoller (started in 14. jobsWorker)
	// The ops listener's admin routes exist from phase 2; they read Redis and
	// the jobs client through these once the later phases have set them.
	redisNow atomic.Pointer[redis.Client]
	jobsNow  atomic.Pointer[jobs]
	sse      *sseHub      // 15. apiListener
	api      *httpServer  // 15. apiListener
	inFlight atomic.Int64 // API requests being served now

	// 10. redisConnect: this instance's record for the cluster dashboard.
	status *statusPublisher
}

func newApp(getenv func(string) string, stdout io.Writer) *app {
	born := time.Now()
	log := newLogger(stdout, getenv("KUMIKO_LOG_FORMAT"))
	m := newMetrics()
	a := &app{getenv: getenv, born: born, log: log, metrics: m, lc: newLifecycle(log, m, born), bus: newEventBus(log, m)}
	a.stop = newStopper(log)
	a.lc.OnStateChange(func(from, to State) {
		a.bus.publish(context.Background(), event{Type: eventStateChanged,
			Payload: stateChanged{InstanceID: a.cfg.InstanceID, From: from.String(), To: to.String()}})
	})
	return a
}

// loadConfig is phase 1. The final log format and the secret scrubbing apply
// before the phase's own log line, so even that line is in the right shape.
func (a *app) loadConfig(ctx context.Context, p *phaseRun) error {
	cfg, err := loadConfig(a.getenv, os.ReadFile)
	if err != nil {
		return err
	}
	a.cfg = cfg
	setLogFormat(a.log, cfg.LogFormat)
	a.log.AddHook(redactHook{secrets: append(cfg.secrets(), otlpSecrets(a.getenv)...)})
	a.log.AddHook(instanceHook{id: cfg.InstanceID})
	a.log.WithField("component", "config").WithFields(cfg.logFields()).Info("config")
	return nil
}

// instanceHook stamps every log line with the instance id, so the logs of two
// instances can be told apart after they are merged.
type instanceHook struct{ id string }

func (instanceHook) Levels() []logrus.Level { return logrus.AllLevels }
func (h instanceHook) Fire(e *logrus.Entry) error {
	e.Data["instance"] = h.id
	return nil
}

// setupObservability is phase 2. Tracing that cannot be set up is a warning
// (the noop provider takes over); an ops port that cannot be bound is not,
// because an orchestrator without probes cannot manage the process.
func (a *app) setupObservability(ctx context.Context, p *phaseRun) error {
	t, traceErr := setupTracing(ctx, a.getenv, a.cfg.InstanceID, version)
	if traceErr != nil {
		p.warn(traceErr.Error())
	}
	a.tracing = t
	a.lc.traceWith(t.tracer)

	a.health = newReadiness(a.lc, a.metrics, a.cfg.Lifecycle.Readiness.ProbeTimeout, a.cfg.Lifecycle.Readiness.CacheTTL)
	a.health.RegisterReadinessCheck("observability", false, func(context.Context) checkResult {
		detail := map[string]any{"provider": t.provider}
		if traceErr != nil {
			detail["error"] = traceErr.Error()
		}
		return okResult(detail)
	})

	e := newEcho(a.log, a.metrics, "ops")
	addOpsRoutes(e, a.lc, a.health, a.metrics, a.cfg.HTTP, a.cfg.AdminToken, a.redisNow.Load, a.jobsNow.Load)
	ops, err := listenHTTP("ops", a.cfg.OpsAddr, e, a.cfg.HTTP, a.log, a.serverFailed)
	if err != nil {
		return err
	}
	a.ops = ops
	return nil
}

// registerAll is phase 5: every feature declares what it brings.
func (a *app) registerAll(ctx context.Context, p *phaseRun) error {
	a.features = a.registerFeatures()
	p.note = fmt.Sprintf("%d features", len(a.features))
	return nil
}

// validateBoot is phase 6.
func (a *app) validateBoot(ctx context.Context, p *phaseRun) error {
	return validateFeatures(a.features)
}

// listenAPI is phase 15: the event stream hub, then the socket, bound here so
// that "address in use" ends the boot at once instead of surfacing later in a
// goroutine.
func (a *app) listenAPI(ctx context.Context, p *phaseRun) error {
	hub := newSSEHub(a.db, a.redis, a.cfg.SSE, a.cfg.Outbox.PollInterval, a.log, a.metrics, func(r any) { a.panicked("sse", r) })
	if err := hub.Start(ctx); err != nil {
		return err
	}
	a.sse = hub
	a.lc.RegisterShutdownHook("sseHub", hub.Stop)

	e := newEcho(a.log, a.metrics, "api")
	e.IPExtractor = clientIPExtractor(a.cfg.HTTP.TrustedProxies)
	addAPIRoutes(e, a.lc, a.health, a.features, a.metrics, a.cfg.HTTP, &a.inFlight, a.tracing.tracer)
	api, err := listenHTTP("api", a.cfg.HTTPAddr, e, a.cfg.HTTP, a.log, a.serverFailed)
	if err != nil {
		return err
	}
	a.api = api
	return nil
}

// startOutboxPoller is phase 13. The River client is created first, not yet
// started, because delivering an event inserts the jobs it triggers; its stop
// hook is registered before the poller's, so the drain stops the poller
// first and the jobs worker after it. Three tries: the framework's guarantees
// need a working poller; then the boot ends.
func (a *app) startOutboxPoller(ctx context.Context, p *phaseRun) error {
	j, err := newJobs(jobDeps{db: a.db, search: a.search, storage: a.storage, bucket: a.cfg.Storage.Bucket,
		masterKey: a.masterKey, log: a.log.WithField("component", "jobs"), outboxRetention: a.cfg.Outbox.Retention},
		a.cfg.Jobs, a.cfg.InstanceID, a.features, a.tracing.tracer, a.metrics)
	if err != nil {
		return err
	}
	a.jobs = j
	a.jobsNow.Store(j)
	a.lc.RegisterShutdownHook("jobsWorker", j.Stop)

	beat := a.heartbeats.RegisterHeartbeat("outbox", "outboxPoller")
	poller := newOutboxPoller(a.db, a.redis, a.cfg.Outbox, beat, a.cfg.Lifecycle.Heartbeat.Interval, j.insertForEvents,
		a.log, a.metrics, func(r any) { a.panicked("outboxPoller", r) })
	if err := a.retry(ctx, p, "outboxPoller", 3, poller.Start); err != nil {
		return err
	}
	a.lc.RegisterShutdownHook("outboxPoller", poller.Stop)
	a.bus.subscribe(eventStateChanged, recordStateChanges(a.db, a.log.WithField("component", "events")))
	return nil
}

// startJobsWorker is phase 14: River starts working jobs, its heartbeat
// starts, and the leader election starts the cron scheduler on whichever
// instance leads. Three tries each, then the boot ends.
func (a *app) startJobsWorker(ctx context.Context, p *phaseRun) error {
	if err := a.retry(ctx, p, "jobsWorker", 3, a.jobs.Start); err != nil {
		return err
	}
	jobsBeat := newBeatLoop(a.heartbeats.RegisterHeartbeat("jobs", "jobsWorker"), a.cfg.Lifecycle.Heartbeat.Interval,
		a.log.WithField("component", "jobs"))
	if err := jobsBeat.Start(ctx); err != nil {
		return err
	}
	a.lc.RegisterShutdownHook("jobsHeartbeat", jobsBeat.Stop)

	le := a.cfg.Lifecycle.LeaderElection
	if !le.Enabled {
		a.health.RegisterSkipped("schedulerLeader", "KUMIKO_LEADER_ENABLED=false: this instance schedules no cron jobs")
		return nil
	}
	sched := &scheduler{db: a.db, jobs: a.jobs, crons: cronsOf(a.features),
		beat: a.heartbeats.RegisterHeartbeat("scheduler", ""), beatInt: a.cfg.Lifecycle.Heartbeat.Interval,
		log: a.log.WithField("component", "scheduler")}
	el := newElector(a.redis, a.cfg.InstanceID, le.LockTTL, le.RenewInterval, sched.lead, sched.fence, a.log, a.metrics,
		func(r any) { a.panicked("leader", r) })
	if err := a.retry(ctx, p, "leaderElection", 3, el.Start); err != nil {
		return err
	}
	a.lc.RegisterShutdownHook("leaderElection", el.Stop)
	a.health.RegisterReadinessCheck("schedulerLeader", false, el.readinessCheck)
	return nil
}

// mustSchedule parses a cron spec that phase 6 has already validated.
func mustSchedule(spec string) cron.Schedule {
	s, err := cronParser.Parse(spec)
	if err != nil {
		panic(fmt.Sprintf("cron spec %q passed bootValidation but does not parse: %v", spec, err))
	}
	return s
}

// confirmReady is phase 16: one real probe of every gating check before the
// first 200, so readiness never claims what the dependencies cannot back.
func (a *app) confirmReady(ctx context.Context, p *phaseRun) error {
	if failing := a.health.failingGates(a.health.probe(ctx)); len(failing) > 0 {
		return fmt.Errorf("readiness checks failing: %s", strings.Join(failing, "; "))
	}
	return nil
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

// serverFailed turns a listener that stopped serving into a shutdown.
func (a *app) serverFailed(err error) {
	a.log.WithField("component", "lifecycle").WithError(err).Error("listener failed")
	a.stop.request(stopRequest{reason: "listener failed", failed: true})
}

// recoverToShutdown is deferred first in every background goroutine the app
// starts itself; components take panicked as their onPanic.
func (a *app) recoverToShutdown(component string) {
	if r := recover(); r != nil {
		a.panicked(component, r)
	}
}

// panicked handles a panic in a background goroutine. The process is in an
// unknown state now: the panic is logged with its stack, counted, and starts a
// graceful shutdown that ends in exit 1.
func (a *app) panicked(component string, recovered any) {
	a.metrics.panics.WithLabelValues(component).Inc()
	a.log.WithFields(logrus.Fields{"component": component, "panic": fmt.Sprint(recovered), "stack": string(debug.Stack())}).Error("background goroutine panicked")
	a.stop.request(stopRequest{reason: "panic in " + component, failed: true})
}
