package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/meilisearch/meilisearch-go"
	"github.com/minio/minio-go/v7"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/riverqueue/river"
	"github.com/sirupsen/logrus"
)

// feature is the one place a capability is wired: the events it publishes,
// the River jobs it works and what starts them (an outbox event, a cron
// schedule, an operator), its routes and the settings it cannot work without.
// A job is named by its args type, as in River: the kind string lives in the
// type's Kind method and nowhere else. Phase 6 checks the whole list before
// anything connects.
type feature struct {
	name          string
	publishes     []string
	workers       []worker       // the job kinds this feature works
	subscriptions []subscription // outbox event → a job
	crons         []cronJob      // schedule → a job (inserted by the leader only)
	manualJobs    []manualJob    // POST /admin/jobs/{kind}/run → a job
	searchIndexes []searchIndex  // Meilisearch indexes phase 11 makes sure exist
	routes        []route
	collectors    []prometheus.Collector // the feature's own metrics, registered in phase 5
	requires      []setting
	uses          []dependency // what its routes and workers are given (see dependency)
}

// dependency is one of the connections and services a feature's routes and
// workers may be given. A feature lists the ones it uses; phases 13 and 15
// hand it those and leave the others nil. Its wiring then says on one line
// what it touches, and a handler or job that reaches for one it did not
// declare fails at its first request or run, in the tests, which run every
// route and job. The process's own config, deadlines, lifecycle, metrics and
// log are everyone's.
type dependency int

const (
	usesDB        dependency = iota + 1
	usesRedis                // the Redis client (a hint: every feature must work while it is down)
	usesSearch               // Meilisearch; nil too when not configured or not reachable at boot
	usesStorage              // the S3 client and its bucket; nil too when not configured
	usesMasterKey            // the key that seals and signs (secrets.go)
	usesStreams              // the event stream hub
	usesJobs                 // the jobs client (River)
)

// registerFeatures is phase 5: every feature of the process, in one list.
func registerFeatures(cfg config) []feature {
	return []feature{
		lifecycleFeature(),
		outboxRetentionFeature(cfg.Outbox),
		eventsFeature(),
		instanceFeature(),
		jobsFeature(),
		drainDemoFeature(cfg.HTTP),
		ordersFeature(cfg), // the orders demo: delete this line and orders*.go to remove it
	}
}

// route is one HTTP route. Its handler is built in phase 15, once everything
// it uses exists. A streaming route (SSE) is not an in-flight request for the
// drain: it is ended by drain step 4, not waited for. A long-running route
// (a stream, or a request that waits by design, like /api/slow) is not
// admission-controlled: its duration says nothing about the instance's load
// (admission.go). An admin route is served on the ops port under /admin,
// behind the admin token. A static route (a page) costs no dependency: it is
// rate-limited and nothing else, and served in every state.
type route struct {
	method, path string
	handler      func(routeDeps) echo.HandlerFunc
	streaming    bool
	longRunning  bool
	admin        bool
	static       bool
}

// routeDeps is what route handlers are built from, in phase 15: the
// process's own pieces, and of the rest what the feature uses (the others nil).
type routeDeps struct {
	cfg      config
	timeouts timeouts
	lc       *Lifecycle
	metrics  *metrics
	log      *logrus.Logger

	db        *pgxpool.Pool              // usesDB
	redis     *redis.Client              // usesRedis
	search    meilisearch.ServiceManager // usesSearch
	masterKey *masterKey                 // usesMasterKey
	sse       *sseHub                    // usesStreams
	jobs      *jobs                      // usesJobs
}

// usedBy is d with only what f uses of the dependencies.
func (d routeDeps) usedBy(f feature) routeDeps {
	return routeDeps{cfg: d.cfg, timeouts: d.timeouts, lc: d.lc, metrics: d.metrics, log: d.log,
		db: given(f, usesDB, d.db), redis: given(f, usesRedis, d.redis), search: given(f, usesSearch, d.search),
		masterKey: given(f, usesMasterKey, d.masterKey), sse: given(f, usesStreams, d.sse), jobs: given(f, usesJobs, d.jobs)}
}

// anyUses reports whether some feature uses dep: a dependency nothing uses
// is not connected to (phases 11 and 12).
func anyUses(features []feature, dep dependency) bool {
	return slices.ContainsFunc(features, func(f feature) bool { return slices.Contains(f.uses, dep) })
}

// given is v when f uses dep, else nothing.
func given[T any](f feature, dep dependency, v T) T {
	if slices.Contains(f.uses, dep) {
		return v
	}
	var none T
	return none
}

// workDeps is what job workers use, from phase 13 on: the log and the bound
// of an outside call, and of the rest what the feature uses (the others nil).
type workDeps struct {
	log *logrus.Entry
	// call bounds one call to a dependency outside the database (Meilisearch,
	// S3), far below the job's timeout: a hung server fails the attempt,
	// River retries it later, and the worker is free for the next job.
	call time.Duration

	db        *pgxpool.Pool              // usesDB
	search    meilisearch.ServiceManager // usesSearch
	storage   *minio.Client              // usesStorage
	bucket    string                     // usesStorage
	masterKey *masterKey                 // usesMasterKey
}

// usedBy is d with only what f uses of the dependencies.
func (d workDeps) usedBy(f feature) workDeps {
	return workDeps{log: d.log, call: d.call,
		db: given(f, usesDB, d.db), search: given(f, usesSearch, d.search), masterKey: given(f, usesMasterKey, d.masterKey),
		storage: given(f, usesStorage, d.storage), bucket: given(f, usesStorage, d.bucket)}
}

// demo:begin (a bare copy has no job that calls out, nor one an event triggers: these go too)
// external is the context of one call to a dependency outside the database.
func (d workDeps) external(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.call)
}

// demo:end

// worker is one job kind and the function that works it.
type worker struct {
	kind     string
	register func(*river.Workers, workDeps)
}

// work declares the worker of the jobs whose args are T; run gets the
// workers' dependencies, which exist once phase 13 runs.
func work[T river.JobArgs](run func(workDeps, context.Context, *river.Job[T]) error) worker {
	return worker{kind: kindOf[T](), register: func(ws *river.Workers, d workDeps) {
		river.AddWorker(ws, river.WorkFunc(func(ctx context.Context, job *river.Job[T]) error { return run(d, ctx, job) }))
	}}
}

// subscription inserts one job for the delivered events of one type in one
// delivery batch (at most KUMIKO_OUTBOX_BATCH_SIZE), in the delivery's
// transaction. A job that works a batch at once (one search call for many
// documents) costs River one job, not one per event; a job that must work
// each event alone loops over them. When a batch's jobs cannot be made, each
// event is tried alone, so only the bad one fails (outboxPoller.insertJobs).
type subscription struct {
	event, kind string
	args        func([]outboxEvent) (river.JobArgs, error)
}

// demo:begin (the demo is the only subscriber: a bare copy drops this)
// subscribe declares the jobs of args T that events of one type trigger.
func subscribe[T river.JobArgs](event string, args func([]outboxEvent) (T, error)) subscription {
	return subscription{event: event, kind: kindOf[T](), args: func(evs []outboxEvent) (river.JobArgs, error) { return args(evs) }}
}

// demo:end

// cronJob inserts a job on every tick of spec. Its args carry the tick (a
// unique key, so two leaders never enqueue one tick twice) and the leader's
// fencing token.
type cronJob struct {
	kind, spec string
	args       func(tick time.Time, fencingToken int64) river.JobArgs
}

func schedule[T river.JobArgs](spec string, args func(tick time.Time, fencingToken int64) T) cronJob {
	return cronJob{kind: kindOf[T](), spec: spec, args: func(tick time.Time, token int64) river.JobArgs { return args(tick, token) }}
}

// CronRun is what the args of a scheduled job carry: the tick it runs for,
// the fencing token of the leader that enqueued it, and whether an operator
// ran it by hand instead. ScheduledAt is unique: two leaders (or a leader and
// its stale predecessor) can never enqueue the same tick twice. A job's args
// embed it; it is exported because River reads the unique tag only through
// exported embedded fields.
type CronRun struct {
	ScheduledAt  time.Time `json:"scheduledAt" river:"unique"`
	FencingToken int64     `json:"fencingToken,omitempty"`
	Manual       bool      `json:"manual,omitempty"`
}

func (CronRun) InsertOpts() river.InsertOpts {
	return river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}
}

// manualJob is a job an operator may run by hand; args reads the request
// (and answers bad input with an apiError).
type manualJob struct {
	kind string
	args func(echo.Context) (river.JobArgs, error)
}

func byHand[T river.JobArgs](args func(echo.Context) (T, error)) manualJob {
	return manualJob{kind: kindOf[T](), args: func(c echo.Context) (river.JobArgs, error) { return args(c) }}
}

func kindOf[T river.JobArgs]() string {
	var args T
	return args.Kind()
}

// setting is a configuration value a feature needs; present says whether it is set.
type setting struct {
	name    string
	present bool
}

// workerKinds is every job kind some feature works, in declaration order.
func workerKinds(features []feature) []string {
	var kinds []string
	for _, f := range features {
		for _, w := range f.workers {
			kinds = append(kinds, w.kind)
		}
	}
	return kinds
}

// validateFeatures is phase 6: every problem of the feature list, all at once.
// A job that something starts but no feature works would otherwise surface
// only when the first event is delivered, as a poison event.
func validateFeatures(features []feature, haveMasterKey bool) error {
	var problems []error
	seen := func(kind string) func(owner, name string) {
		owners := map[string]string{}
		return func(owner, name string) {
			if first, dup := owners[name]; dup {
				problems = append(problems, fmt.Errorf("%s %q is declared by both %s and %s", kind, name, first, owner))
				return
			}
			owners[name] = owner
		}
	}
	featureName, routeKey, eventName, jobKind := seen("feature"), seen("route"), seen("event"), seen("job")

	events := map[string]bool{}
	for _, f := range features {
		featureName("the feature list", f.name)
		for _, e := range f.publishes {
			eventName(f.name, e)
			events[e] = true
		}
		for _, w := range f.workers {
			jobKind(f.name, w.kind)
		}
		if slices.Contains(f.uses, usesMasterKey) && !haveMasterKey {
			problems = append(problems, fmt.Errorf("feature %s uses the master key: set KUMIKO_MASTER_KEY "+
				"(base64 of 32 random bytes: head -c 32 /dev/urandom | base64) or KUMIKO_MASTER_KEY_FILE", f.name))
		}
		for _, s := range f.requires {
			if !s.present {
				problems = append(problems, fmt.Errorf("feature %s needs %s, which is not set", f.name, s.name))
			}
		}
		for _, r := range f.routes {
			prefix := "/api/"
			switch {
			case r.admin:
				prefix = "/admin/"
			case r.static:
				prefix = "/" // a page, anywhere on the API port
			}
			routeKey(f.name, r.method+" "+r.path)
			if !strings.HasPrefix(r.path, prefix) {
				problems = append(problems, fmt.Errorf("feature %s: route %s %s is outside %s", f.name, r.method, r.path, prefix))
			}
		}
	}
	// References are checked once every declaration is known, so the order of
	// the feature list does not matter.
	worked := workerKinds(features)
	unworked := func(f feature, kind, how string) {
		if !slices.Contains(worked, kind) {
			problems = append(problems, fmt.Errorf("feature %s %s job %q, which no feature works (no worker)", f.name, how, kind))
		}
	}
	for _, f := range features {
		for _, s := range f.subscriptions {
			if !events[s.event] {
				problems = append(problems, fmt.Errorf("feature %s subscribes to unknown event %q", f.name, s.event))
			}
			unworked(f, s.kind, "subscribes "+s.event+" to")
		}
		for _, c := range f.crons {
			unworked(f, c.kind, "schedules")
			if _, err := parseSchedule(c.spec); err != nil {
				problems = append(problems, fmt.Errorf("feature %s: cron %q for job %s: %w", f.name, c.spec, c.kind, err))
			}
		}
		for _, m := range f.manualJobs {
			unworked(f, m.kind, "lets an operator run")
		}
	}
	return errors.Join(problems...)
}
