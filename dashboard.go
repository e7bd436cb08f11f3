package main

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
	"golang.org/x/sync/singleflight"
)

// componentClusterStatus is this instance's record for the cluster dashboard.
var componentClusterStatus = component{name: "clusterStatus"}

// dashboardPage is the live dashboard: plain HTML and JavaScript, no build step.
//
//go:embed dashboard.html
var dashboardPage []byte

// handleDashboard is GET / on the API port. Its Content-Security-Policy
// allows exactly the page's own inline <script> and <style> blocks by hash (no
// 'unsafe-inline'), so an injected script or style would not run.
func handleDashboard() echo.HandlerFunc {
	csp := dashboardCSP(dashboardPage)
	return func(c echo.Context) error {
		h := c.Response().Header()
		h.Set("Cache-Control", "no-store")
		h.Set("Content-Security-Policy", csp)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		return c.Blob(http.StatusOK, echo.MIMETextHTMLCharsetUTF8, dashboardPage)
	}
}

var (
	inlineScript = regexp.MustCompile(`(?s)<script>(.*?)</script>`)
	inlineStyle  = regexp.MustCompile(`(?s)<style>(.*?)</style>`)
)

// dashboardCSP builds the policy from the page: the SHA-256 of every inline
// block, so editing the page never needs a hand-kept hash.
func dashboardCSP(page []byte) string {
	hashes := func(re *regexp.Regexp) string {
		var out string
		for _, m := range re.FindAllSubmatch(page, -1) {
			sum := sha256.Sum256(m[1])
			out += " 'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
		}
		return out
	}
	return "default-src 'none'; script-src" + hashes(inlineScript) + "; style-src" + hashes(inlineStyle) +
		"; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
}

// publicPhase is a boot phase as a dashboard viewer sees it: no notes, since
// a phase's note or warning can carry an endpoint or error text.
type publicPhase struct {
	Phase      string       `json:"phase"`
	DurationMs int64        `json:"durationMs"`
	Outcome    phaseOutcome `json:"outcome"`
	Retries    int          `json:"retries"`
}

// clusterCache reads the cluster at most once per TTL (clusterCacheTTL);
// concurrent misses share one read (single flight).
type clusterCache struct {
	rdb     *redis.Client
	ttl     time.Duration
	timeout time.Duration // the request budget: a hung Redis is a 503 within it
	group   singleflight.Group

	mu     sync.Mutex
	last   cluster
	lastAt time.Time
}

func (cc *clusterCache) get(ctx context.Context) (cluster, error) {
	cc.mu.Lock()
	if !cc.lastAt.IsZero() && time.Since(cc.lastAt) < cc.ttl {
		cl := cc.last
		cc.mu.Unlock()
		return cl, nil
	}
	cc.mu.Unlock()
	v, err, _ := cc.group.Do("cluster", func() (any, error) {
		// The read belongs to every waiter: one client hanging up must not fail the others.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cc.timeout)
		defer cancel()
		cl, err := readCluster(rctx, cc.rdb)
		if err != nil {
			return cluster{}, err
		}
		cc.mu.Lock()
		cc.last, cc.lastAt = cl, time.Now()
		cc.mu.Unlock()
		return cl, nil
	})
	return v.(cluster), err
}

// handleInstance is GET /api/instance, what the dashboard shows, public on the
// API port: this instance's state and boot timeline (phase, duration, outcome,
// retries), the leader's instance id, the live workers (worker name,
// instance id, heartbeat age) and every instance's status record (state, boot
// phases placed in time, requests per second, drain steps). Nothing else: no
// notes, errors, URLs or versions; those stay behind the admin token on the
// ops port.
func handleInstance(lc *Lifecycle, rdb *redis.Client, instanceID string, budget time.Duration) echo.HandlerFunc {
	cache := &clusterCache{rdb: rdb, ttl: clusterCacheTTL, timeout: budget}
	return func(c echo.Context) error {
		cl, err := cache.get(c.Request().Context())
		if err != nil {
			return apiError(http.StatusServiceUnavailable, "unavailable", "the cluster view is unavailable right now")
		}
		timeline := lc.Timeline()
		phases := make([]publicPhase, len(timeline))
		for i, p := range timeline {
			phases[i] = publicPhase{Phase: p.Phase, DurationMs: p.DurationMs, Outcome: p.Outcome, Retries: p.Retries}
		}
		workers := cl.Workers
		if workers == nil {
			workers = []liveWorker{}
		}
		instances := cl.Instances
		if instances == nil {
			instances = []instanceStatus{}
		}
		return c.JSON(http.StatusOK, map[string]any{
			"instanceId": instanceID,
			"state":      lc.State().String(),
			"uptimeSec":  int64(lc.Uptime().Seconds()),
			"phases":     phases,
			"leader":     cl.Leader,
			"workers":    workers,
			"instances":  instances,
		})
	}
}

// The cluster view. Every instance publishes its own status to Redis —
// state, boot timeline, requests per second, the drain steps so far — under
// a TTL'd key next to its heartbeats, and every instance's /api/instance
// reads all of them: the page shows the whole cluster whichever instance (or
// load balancer) serves it. How often and for how long: statusInterval,
// statusTTL and stoppedTTL (timeouts.go).
const (
	// maxDrainSteps and maxClusterInstances bound a record and a read.
	maxDrainSteps       = 32
	maxClusterInstances = 32
)

// statusPhase is a boot phase placed in time: startMs from the first phase's start.
type statusPhase struct {
	Phase      string       `json:"phase"`
	StartMs    int64        `json:"startMs"`
	DurationMs int64        `json:"durationMs"`
	Outcome    phaseOutcome `json:"outcome"`
	Retries    int          `json:"retries"`
}

// drainStep is a finished drain step; no error text (it may carry an address).
type drainStep struct {
	Step       string `json:"step"`
	DurationMs int64  `json:"durationMs"`
	OK         bool   `json:"ok"`
}

// instanceStatus is one instance's record in Redis, public as is.
type instanceStatus struct {
	InstanceID string        `json:"instanceId"`
	State      string        `json:"state"`
	UptimeSec  int64         `json:"uptimeSec"`
	RPS        float64       `json:"rps"`
	Phases     []statusPhase `json:"phases"`
	Drain      []drainStep   `json:"drain"`
	// LingerEnded says what ended the drain's linger: "quiet" (the load
	// balancer had stopped sending) or "max" (KUMIKO_LINGER); empty before.
	LingerEnded string `json:"lingerEnded,omitempty"`
	// JobsInterrupted counts the jobs the drain cut off and put back
	// without spending an attempt (kumiko_jobs_total{result="interrupted"}).
	JobsInterrupted int64 `json:"jobsInterrupted"`
	// JobsBacklog is the jobs that wait to be worked, as this instance last
	// counted them (backlog.go); past JobsBacklogBound follow-up work is delayed.
	JobsBacklog      int64 `json:"jobsBacklog"`
	JobsBacklogBound int64 `json:"jobsBacklogBound"`
	// CronTicksSkipped counts the cron ticks this instance passed over
	// while it led (kumiko_cron_ticks_skipped_total): the missed-tick rule
	// runs the newest missed tick once and skips the older ones.
	CronTicksSkipped int64 `json:"cronTicksSkipped"`
	UpdatedAt        int64 `json:"updatedAt"` // unix milliseconds
}

// statusPublisher writes this instance's record every statusInterval, and at
// once (from its goroutine) on a state change or a drain step.
type statusPublisher struct {
	*startStop // stopNow: nothing in flight needs finishing
	rdb        *redis.Client
	instanceID string
	lc         *Lifecycle
	figures    statusFigures
	log        *logrus.Entry

	kick  chan struct{}
	unsub func()

	mu          sync.Mutex
	drain       []drainStep
	lingerEnded string
	rps         float64
	lastCount   float64
	lastAt      time.Time
}

// statusFigures are the metrics a record shows, from the core and the blocks.
type statusFigures struct {
	requests prometheus.Collector // kumiko_http_requests_total: rps is its rate
	jobs     prometheus.Collector // kumiko_jobs_total: its interrupted jobs
	skipped  prometheus.Collector // kumiko_cron_ticks_skipped_total
	backlog  prometheus.Gauge     // kumiko_jobs_backlog
	bound    prometheus.Gauge     // kumiko_jobs_backlog_bound
}

func newStatusPublisher(rdb *redis.Client, instanceID string, lc *Lifecycle, figures statusFigures, log *logrus.Logger,
	onPanic func(c component, recovered any)) *statusPublisher {
	return &statusPublisher{startStop: newStartStop(componentClusterStatus, stopNow, onPanic), rdb: rdb, instanceID: instanceID,
		lc: lc, figures: figures, log: componentClusterStatus.log(log), kick: make(chan struct{}, 1)}
}

// Start starts the loop, which writes the first record at once; Stop ends
// it. A Redis hiccup costs the page a second of freshness, never the boot.
func (sp *statusPublisher) Start(ctx context.Context) error {
	return sp.start(ctx, func(context.Context) error {
		sp.lastCount, sp.lastAt = sp.requestCount(), time.Now()
		sp.unsub = sp.lc.OnStateChange(func(_, _ State) { sp.poke() })
		sp.poke()
		return nil
	}, sp.run)
}

func (sp *statusPublisher) poke() {
	select {
	case sp.kick <- struct{}{}:
	default: // a write is already due
	}
}

func (sp *statusPublisher) run(ctx context.Context) {
	everyTick(ctx, statusInterval, sp.kick, func(ctx context.Context) {
		ctx, cancel := context.WithTimeout(ctx, statusInterval)
		defer cancel()
		if err := sp.write(ctx, sp.lc.State().String(), statusTTL); err != nil {
			sp.log.WithError(err).Debug("publishing the instance status")
		}
	})
}

// stepDone records a finished drain step (called by the drain, never blocks on Redis).
func (sp *statusPublisher) stepDone(name string, took time.Duration, err error) {
	if sp == nil {
		return // the drain of a boot that failed before Redis
	}
	sp.mu.Lock()
	if len(sp.drain) < maxDrainSteps {
		sp.drain = append(sp.drain, drainStep{Step: name, DurationMs: took.Milliseconds(), OK: err == nil})
	}
	sp.mu.Unlock()
	sp.poke()
}

// lingerDone records what ended the drain's linger: quiet or max.
func (sp *statusPublisher) lingerDone(reason string) {
	if sp == nil {
		return
	}
	sp.mu.Lock()
	sp.lingerEnded = reason
	sp.mu.Unlock()
	sp.poke()
}

// Stop ends the loop, then writes the last record: "stopped", kept for
// stoppedTTL. It runs as the shutdown hook just before the Redis client
// closes — after it the instance only closes Redis and the DB pool and
// exits — so for the cluster this is the moment the instance has left.
func (sp *statusPublisher) Stop(ctx context.Context) error {
	if sp.unsub == nil {
		return nil // never started
	}
	sp.unsub()
	if err := sp.startStop.Stop(ctx); err != nil {
		return err
	}
	// The page is a view: its hook is best effort (the record expires by itself).
	if err := sp.write(ctx, StateStopped.String(), stoppedTTL); err != nil {
		return fmt.Errorf("the dashboard will not show this instance as stopped: %w", err)
	}
	return nil
}

// requestCount sums kumiko_http_requests_total over its labels.
func (sp *statusPublisher) requestCount() float64 { return counterSum(sp.figures.requests, "", "") }

// interruptedJobs sums kumiko_jobs_total{result="interrupted"} over the job kinds.
func (sp *statusPublisher) interruptedJobs() int64 {
	return int64(counterSum(sp.figures.jobs, "result", "interrupted"))
}

// counterSum sums a counter's series whose label name has value; all of
// them when name is empty.
func counterSum(c prometheus.Collector, name, value string) float64 {
	ch := make(chan prometheus.Metric, 64)
	go func() { c.Collect(ch); close(ch) }()
	var total float64
	for m := range ch {
		var pb dto.Metric
		if m.Write(&pb) != nil || pb.Counter == nil {
			continue
		}
		if name == "" || slices.ContainsFunc(pb.Label, func(l *dto.LabelPair) bool { return l.GetName() == name && l.GetValue() == value }) {
			total += pb.Counter.GetValue()
		}
	}
	return total
}

// gaugeValue is a gauge's value.
func gaugeValue(g prometheus.Gauge) float64 {
	var pb dto.Metric
	if g.Write(&pb) != nil {
		return 0
	}
	return pb.GetGauge().GetValue()
}

func (sp *statusPublisher) snapshot(state string) instanceStatus {
	now := time.Now()
	count, interrupted := sp.requestCount(), sp.interruptedJobs()
	timeline := sp.lc.Timeline()
	phases := make([]statusPhase, len(timeline))
	for i, p := range timeline {
		phases[i] = statusPhase{Phase: p.Phase, StartMs: p.StartedAt.Sub(timeline[0].StartedAt).Milliseconds(),
			DurationMs: p.DurationMs, Outcome: p.Outcome, Retries: p.Retries}
	}
	sp.mu.Lock()
	defer sp.mu.Unlock()
	// A write kicked right after a tick keeps the last rate: a rate over a
	// few milliseconds says nothing.
	if secs := now.Sub(sp.lastAt).Seconds(); secs >= statusInterval.Seconds()/2 {
		sp.rps = (count - sp.lastCount) / secs
		sp.lastCount, sp.lastAt = count, now
	}
	return instanceStatus{InstanceID: sp.instanceID, State: state, UptimeSec: int64(sp.lc.Uptime().Seconds()),
		RPS: math.Round(sp.rps*10) / 10, Phases: phases, Drain: append([]drainStep{}, sp.drain...),
		LingerEnded: sp.lingerEnded, JobsInterrupted: interrupted,
		JobsBacklog: int64(gaugeValue(sp.figures.backlog)), JobsBacklogBound: int64(gaugeValue(sp.figures.bound)),
		CronTicksSkipped: int64(counterSum(sp.figures.skipped, "", "")), UpdatedAt: now.UnixMilli()}
}

// statusScript writes an instance's status record (KEYS[1], ARGV[1], TTL
// ARGV[2] ms) and its entry in the index (KEYS[2], member ARGV[3]). The index
// lists the records by expiry, so a reader needs no SCAN; every writer prunes
// the expired entries, and the index expires (ARGV[4] ms) when no instance
// writes any more. Expiries are Redis's clock (TIME), not the writer's: a
// writer whose clock runs 5 s ahead would otherwise prune the others' records.
var statusScript = redis.NewScript(`
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call("SET", KEYS[1], ARGV[1], "PX", ARGV[2])
redis.call("ZADD", KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
redis.call("ZREMRANGEBYSCORE", KEYS[2], "-inf", now)
return redis.call("PEXPIRE", KEYS[2], ARGV[4])`)

func (sp *statusPublisher) write(ctx context.Context, state string, ttl time.Duration) error {
	data, err := json.Marshal(sp.snapshot(state))
	if err != nil {
		return fmt.Errorf("encoding the instance status: %w", err)
	}
	err = statusScript.Run(ctx, sp.rdb, []string{statusKeyPrefix + sp.instanceID, statusIndexKey},
		data, ttl.Milliseconds(), sp.instanceID, stoppedTTL.Milliseconds()).Err()
	if err != nil {
		return fmt.Errorf("writing the instance status: %w", err)
	}
	return nil
}

// instanceFeature is the dashboard: the page, GET /api/instance, which the
// page polls (the status records of every instance in the cluster), and the
// same view for operators, GET /admin/workers.
func instanceFeature() feature {
	return feature{name: "instance", uses: []dependency{usesRedis}, routes: []route{
		{method: http.MethodGet, path: "/", static: true, handler: func(routeDeps) echo.HandlerFunc { return handleDashboard() }},
		{method: http.MethodGet, path: "/api/instance", handler: func(d routeDeps) echo.HandlerFunc {
			return handleInstance(d.lc, d.redis, d.cfg.InstanceID, d.timeouts.request)
		}},
		{method: http.MethodGet, path: "/admin/workers", admin: true, handler: func(d routeDeps) echo.HandlerFunc { return handleWorkers(d.redis) }},
	}}
}

// handleWorkers is GET /admin/workers: the live workers of every instance
// (their heartbeat keys), the current leader and every instance's record.
func handleWorkers(rdb *redis.Client) echo.HandlerFunc {
	return func(c echo.Context) error {
		cl, err := readCluster(c.Request().Context(), rdb)
		if err != nil {
			return err
		}
		return c.JSON(http.StatusOK, cl)
	}
}

// cluster is what any instance can see of all of them: the live workers, the
// leader and each instance's published status (dashboard.go).
type cluster struct {
	Workers   []liveWorker     `json:"workers"`
	Leader    string           `json:"leader"`
	Instances []instanceStatus `json:"instances"`
}

// readCluster reads the live workers and the current leader from Redis
// (for /admin/workers and the dashboard).
func readCluster(ctx context.Context, rdb *redis.Client) (cluster, error) {
	workers, err := listLiveWorkers(ctx, rdb)
	if err != nil {
		return cluster{}, err
	}
	leader, err := currentLeader(ctx, rdb)
	if err != nil {
		return cluster{}, err
	}
	instances, err := listInstances(ctx, rdb)
	if err != nil {
		return cluster{}, err
	}
	return cluster{Workers: workers, Leader: leader, Instances: instances}, nil
}

// listInstances reads the status records of at most maxClusterInstances
// instances, ordered by instance id: the ids from the index (those whose
// record has not expired), then one MGET. A record that does not parse is
// skipped: the page shows the others.
func listInstances(ctx context.Context, rdb *redis.Client) ([]instanceStatus, error) {
	// Expiries in the index are Redis's clock (statusScript): compared with it too.
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("reading the Redis clock: %w", err)
	}
	ids, err := rdb.ZRangeByScore(ctx, statusIndexKey, &redis.ZRangeBy{
		Min: strconv.FormatInt(now.UnixMilli(), 10), Max: "+inf", Count: maxClusterInstances}).Result()
	if err != nil {
		return nil, fmt.Errorf("reading the instance status index: %w", err)
	}
	keys := make([]string, len(ids))
	for i, id := range ids {
		keys[i] = statusKeyPrefix + id
	}
	instances := []instanceStatus{}
	if len(keys) == 0 {
		return instances, nil
	}
	values, err := rdb.MGet(ctx, keys...).Result()
	if err != nil {
		return nil, fmt.Errorf("reading instance status keys: %w", err)
	}
	for _, v := range values {
		raw, ok := v.(string) // nil: expired between the index read and MGET
		var st instanceStatus
		if ok && json.Unmarshal([]byte(raw), &st) == nil {
			instances = append(instances, st)
		}
	}
	sort.Slice(instances, func(i, j int) bool { return instances[i].InstanceID < instances[j].InstanceID })
	return instances, nil
}
