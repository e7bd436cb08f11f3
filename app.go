package main

import (
	"context"
	"fmt"
	"io"
	"runtime/debug"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/meilisearch/meilisearch-go"
	"github.com/minio/minio-go/v7"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// The service's names, in one place: the Go code derives every name from
// this block. Environment variables keep their literal KUMIKO_ names
// (greppable, and the SPEC names them).
const (
	serviceName     = "kumiko-lifecycle-demo" // binary, `version`, OTel service.name and tracer, Postgres/Redis client names
	metricNamespace = "kumiko"                // every metric is kumiko_<name>
	redisKeyPrefix  = "kumiko:"               // every Redis key and channel of this service (redis.go lists them)
	// advisoryLockKey is this service's Postgres advisory lock ("kumiko" in
	// ASCII). Two services sharing a database need different keys.
	advisoryLockKey = 0x6b756d696b6f
)

// version is set at build time: go build -ldflags "-X main.version=v1.2.3".
var version = "dev"

// app is the composition root of one process: what the boot acquired, in the
// order it acquired it, passed on to whatever needs it. Every field below the
// first block is set by exactly one phase (boot.go).
type app struct {
	getenv  func(string) string
	environ []string // every variable getenv may answer, "NAME=value"
	born    time.Time
	log     *logrus.Logger
	metrics *metrics
	blocks  blockMetrics
	lc      *Lifecycle
	stop    *stopper

	cfg        config                     // 1. config
	timeouts   timeouts                   // 1. config
	tracing    tracing                    // 2. observability
	diag       *diagnostics               // 2. observability: the flight recorder, until the exit line
	health     *readiness                 // 2. observability
	ops        *httpServer                // 2. observability
	admin      *adminTree                 // 2. observability; the whole tree from 15. apiListener
	masterKey  *masterKey                 // 3. secrets
	features   []feature                  // 5. featureRegister
	db         *pgxpool.Pool              // 7. dbConnect
	redis      *redis.Client              // 10. redisConnect
	redisOpts  *redis.Options             // 10. redisConnect: REDIS_URL's, for a component that needs a client of its own
	heartbeats *heartbeats                // 10. redisConnect
	status     *statusPublisher           // 10. redisConnect: this instance's record for the cluster dashboard
	search     meilisearch.ServiceManager // 11. searchAdapter
	storage    *minio.Client              // 12. fileStorage
	jobs       *jobs                      // 13. outboxPoller (started in 14. jobsWorker)
	backlog    *backlogWatch              // 14. jobsWorker
	sse        *sseHub                    // 15. apiListener
	api        *httpServer                // 15. apiListener
	admission  *concurrencyLimiter        // 15. apiListener; nil: admission control off
	inFlight   atomic.Int64               // API requests being served now
	rejecting  atomic.Bool                // KUMIKO_DRAIN_REJECT=retry-after, from closeListener on: new API requests get 503
}

func newApp(getenv func(string) string, environ []string, stdout io.Writer) *app {
	born := time.Now()
	log := newLogger(stdout, getenv("KUMIKO_LOG_FORMAT"))
	m := newMetrics()
	a := &app{getenv: getenv, environ: environ, born: born, log: log, metrics: m, lc: newLifecycle(log, m, born),
		timeouts: newTimeouts(defaultConfig())} // until phase 1 has read the config
	a.blocks = newBlockMetrics(m)
	a.stop = newStopper(log)
	return a
}

// blockConfig is the building blocks' settings. Each block declares its
// config type, its rows and its rules in its own file (outboxConfig in
// outbox.go, …); config embeds this, so a.cfg.Outbox reads as a field of the
// config, and its settings come after the core's.
type blockConfig struct {
	Redis          redisConfig
	Heartbeat      heartbeatConfig
	Outbox         outboxConfig
	Jobs           jobsConfig
	Backlog        backlogConfig
	LeaderElection leaderElectionConfig
	SSE            sseConfig
	Search         searchConfig
	Storage        storageConfig
	Orders         ordersConfig // demo:begin (this line) demo:end
}

func (b *blockConfig) settings() []configSetting {
	return slices.Concat(b.Redis.settings(), b.Heartbeat.settings(), b.Outbox.settings(), b.Jobs.settings(), b.Backlog.settings(),
		b.LeaderElection.settings(), b.SSE.settings(), b.Search.settings(), b.Storage.settings(),
		b.Orders.settings(), // demo:begin (this line) demo:end
	)
}

// validate checks the blocks' rules that span several settings; c is the
// whole config, for a rule that names a core setting too.
func (b *blockConfig) validate(c *config) []error {
	return slices.Concat(b.Heartbeat.validate(), b.Outbox.validate(), b.LeaderElection.validate(), b.SSE.validate(c.HTTP),
		b.Storage.validate())
}

// blockComponents lists the building blocks' components, each declared in
// its block's file (componentOutboxPoller in outbox.go, …).
func blockComponents() []component {
	return []component{componentRedis, componentHeartbeats, componentClusterStatus, componentSearch, componentStorage,
		componentOutboxPoller, componentJobsWorker, componentJobsHeartbeat, componentJobsBacklog, componentScheduler,
		componentLeaderElection, componentSSEHub}
}

// blockMetrics is what the building blocks add to /metrics. Each block
// declares its own (outboxMetrics in outbox.go, …); the root makes them on the
// process's registry at start, so every series is there from the first scrape.
type blockMetrics struct {
	heartbeat *heartbeatMetrics
	outbox    *outboxMetrics
	jobs      *jobsMetrics
	backlog   *backlogMetrics
	leader    *leaderMetrics
	cron      *cronMetrics
	sse       *sseMetrics
}

// newBlockMetrics makes the blocks' metrics on m's registry and starts their
// components' series in m at 0.
func newBlockMetrics(m *metrics) blockMetrics {
	m.initComponentSeries(blockComponents())
	r := m.registry
	return blockMetrics{heartbeat: newHeartbeatMetrics(r, blockComponents()), outbox: newOutboxMetrics(r), jobs: newJobsMetrics(r),
		backlog: newBacklogMetrics(r), leader: newLeaderMetrics(r), cron: newCronMetrics(r), sse: newSSEMetrics(r)}
}

// statusFigures is what the dashboard's record shows of them, and the requests.
func (b blockMetrics) statusFigures(requests prometheus.Collector) statusFigures {
	return statusFigures{requests: requests, jobs: b.jobs.worked, skipped: b.cron.ticksSkipped, backlog: b.backlog.backlog, bound: b.backlog.bound}
}

// serverFailed turns a listener that stopped serving into a shutdown.
func (a *app) serverFailed(err error) {
	a.log.WithField("component", "lifecycle").WithError(err).Error("listener failed")
	a.stop.request(stopRequest{reason: "listener failed", failed: true})
}

// The panic policy, one per kind of goroutine; every panic is logged with its
// stack and counted in kumiko_panics_total{component}:
//   - a background component's goroutine (startStop: the poller, the hub, the
//     heartbeats, the elector, the dashboard record): panicked below. The
//     process is in an unknown state: a graceful shutdown, exit 1.
//   - an HTTP handler (recoverPanics, middleware.go): that request is answered 500,
//     the process serves on; a request's state dies with it.
//   - a state-change observer (Lifecycle.notify): the transition goes on; a
//     broken observer must not stop a drain.
//   - a job: River recovers it and the job fails and is retried with
//     backoff, like any failed job (counted failed in kumiko_jobs_total).
//
// panicked handles a panic in a background goroutine.
// The trace and the goroutines are written before the drain begins: they
// show the seconds that led to the panic.
func (a *app) panicked(c component, recovered any) {
	a.metrics.panics.WithLabelValues(c.String()).Inc()
	c.log(a.log).WithFields(logrus.Fields{"panic": fmt.Sprint(recovered), "stack": string(debug.Stack())}).Error("background goroutine panicked")
	a.diag.record(context.Background(), "panic-"+c.String(), fmt.Sprintf("panic in %s: %v", c, recovered), goroutineDump{})
	a.stop.request(stopRequest{reason: "panic in " + c.String(), failed: true})
}
