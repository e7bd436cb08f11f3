package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// componentHeartbeats is this instance's heartbeat keys (cleared on a clean stop).
var componentHeartbeats = component{name: "heartbeats"}

// heartbeatConfig is the heartbeats' settings.
type heartbeatConfig struct {
	Interval time.Duration
	TTL      time.Duration
}

func (c *heartbeatConfig) settings() []configSetting {
	return []configSetting{
		{key: "lifecycle.heartbeat.interval", env: "KUMIKO_HEARTBEAT_INTERVAL", def: "5s", value: durationValue{p: &c.Interval},
			doc: "workers write `kumiko:heartbeat:<worker>:<instance>` this often", old: "lifecycle.heartbeat.intervalSec"},
		{key: "lifecycle.heartbeat.ttl", env: "KUMIKO_HEARTBEAT_TTL", def: "10s", value: durationValue{p: &c.TTL},
			doc: "a heartbeat older than this is stale: readiness 503", old: "lifecycle.heartbeat.ttlSec"},
	}
}

func (c *heartbeatConfig) validate() []error {
	return rule(c.Interval < c.TTL,
		"lifecycle.heartbeat.interval (%s) must be less than ttl (%s), or the heartbeat expires between beats", c.Interval, c.TTL)
}

// heartbeats keeps the "still alive" keys of this instance's background workers:
// SETEX <prefix>heartbeat:<worker>:<instanceId> <ttl> <unix ts>. A worker beats from its
// own loop, so a loop that is stuck stops beating and goes stale: readiness turns
// 503 here, and other instances stop listing it once the key expires. A beat
// that Redis does not take is not staleness: readiness shows it as degraded.
type heartbeats struct {
	rdb        *redis.Client
	instanceID string
	ttl        time.Duration
	timeout    time.Duration // one beat: a hung Redis costs a worker's loop this much
	metrics    *heartbeatMetrics
	health     *readiness

	// born is a monotonic reference: beats are stored as the time since it,
	// so a heartbeat's age is monotonic time and a step of the wall clock
	// (NTP, a VM resumed) cannot make a fresh beat look stale.
	born time.Time

	mu      sync.Mutex
	handles []*heartbeat
}

// heartbeat is one worker's handle.
type heartbeat struct {
	worker string
	key    string
	owner  *heartbeats
	// tried is when the worker's loop last came to beat and last when a beat
	// last reached Redis, both as nanoseconds since owner.born plus 1 (0 =
	// never): a worker that still tries is alive, though Redis may not hear it.
	tried, last atomic.Int64
}

func newHeartbeats(rdb *redis.Client, instanceID string, ttl, timeout time.Duration, m *heartbeatMetrics, rd *readiness) *heartbeats {
	hs := &heartbeats{rdb: rdb, instanceID: instanceID, ttl: ttl, timeout: timeout, metrics: m, health: rd, born: time.Now()}
	m.registry.MustRegister(heartbeatAgeCollector{hs})
	return hs
}

// RegisterHeartbeat returns the handle c beats with, under its heartbeat
// worker name (its declaration). When c's beat gates, a stale beat fails
// readiness under the check named after c; one that does not is a worker
// that only beats while it has work (the scheduler, on the leader). A
// component that writes no heartbeat is a programming error: it panics.
func (hs *heartbeats) RegisterHeartbeat(c component) *heartbeat {
	if c.heartbeat == "" {
		panic(fmt.Sprintf("heartbeats: %s writes no heartbeat (its declaration)", c))
	}
	h := &heartbeat{worker: c.heartbeat, key: heartbeatKeyPrefix + c.heartbeat + ":" + hs.instanceID, owner: hs}
	hs.mu.Lock()
	hs.handles = append(hs.handles, h)
	hs.mu.Unlock()
	if c.gates {
		hs.health.RegisterReadinessCheck(c.String(), true, h.readinessCheck)
	}
	return h
}

// beatLoop beats a heartbeat every interval from its own goroutine, for a
// component (the River client) whose loops live inside a library. Its Stop
// (from startStop, stopNow) ends the loop, cancelling a beat in flight.
type beatLoop struct {
	*startStop
	beat     *heartbeat
	interval time.Duration
	log      *logrus.Entry
}

// newBeatLoop is the loop c, which beats for another component's heartbeat.
func newBeatLoop(c component, beat *heartbeat, interval time.Duration, log *logrus.Logger, onPanic func(component, any)) *beatLoop {
	return &beatLoop{startStop: newStartStop(c, stopNow, onPanic), beat: beat, interval: interval, log: c.log(log)}
}

// Start writes the first beat synchronously — readiness must not see a
// worker without one — then beats from its goroutine.
func (b *beatLoop) Start(ctx context.Context) error {
	return b.start(ctx, b.beat.beat, b.run)
}

func (b *beatLoop) run(ctx context.Context) {
	everyTick(ctx, b.interval, nil, func(ctx context.Context) {
		if err := b.beat.beat(ctx); err != nil && ctx.Err() == nil {
			b.log.WithError(err).Warn("heartbeat")
		}
	})
}

// beatScript sets a heartbeat key with its TTL (PX, so tests can run with
// sub-second TTLs); the value is Redis's own clock (TIME, unix seconds), so
// every instance that reads the age compares it with that same clock, never
// one host's wall clock with another's.
var beatScript = redis.NewScript(`
local now = redis.call("TIME")
return redis.call("SET", KEYS[1], now[1], "PX", ARGV[1])`)

// beat writes the key with the TTL. It waits for Redis at most the owner's
// timeout, so a hung Redis stalls no worker loop (and no stop waiting for
// one) for longer.
func (h *heartbeat) beat(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, h.owner.timeout)
	defer cancel()
	sent := time.Since(h.owner.born)
	h.tried.Store(int64(sent) + 1)
	err := beatScript.Run(ctx, h.owner.rdb, []string{h.key}, h.owner.ttl.Milliseconds()).Err()
	if err != nil {
		h.owner.metrics.written.WithLabelValues(h.worker, "failed").Inc()
		return fmt.Errorf("writing heartbeat %s: %w", h.key, err)
	}
	h.last.Store(int64(sent) + 1)
	h.owner.metrics.written.WithLabelValues(h.worker, "ok").Inc()
	return nil
}

// age is the time since the last successful beat, in monotonic time; ok is
// false before the first.
func (h *heartbeat) age() (time.Duration, bool) { return h.since(&h.last) }

// since is the time since the moment at holds (tried or last).
func (h *heartbeat) since(at *atomic.Int64) (time.Duration, bool) {
	v := at.Load()
	if v == 0 {
		return 0, false
	}
	return time.Since(h.owner.born) - time.Duration(v-1), true
}

// readinessCheck fails when this instance's own worker has stopped beating
// within the TTL: its loop is stuck, which is this instance's trouble alone.
// A worker that beats but cannot reach Redis is shown as degraded (Shared):
// Redis is every instance's, and the worker goes on without it.
func (h *heartbeat) readinessCheck(context.Context) checkResult {
	tried, ok := h.since(&h.tried)
	if !ok {
		return checkResult{OK: false, Detail: map[string]any{"error": "no heartbeat yet"}}
	}
	detail := map[string]any{}
	if tried > h.owner.ttl {
		detail["error"] = fmt.Sprintf("heartbeat is stale (%s old, ttl %s): the worker is stuck", tried.Round(time.Millisecond), h.owner.ttl)
		return checkResult{OK: false, Detail: detail}
	}
	written, ok := h.age()
	if ok {
		detail["heartbeatAgoSec"] = int64(written.Seconds())
	}
	if !ok || written > h.owner.ttl {
		detail["error"] = fmt.Sprintf("the worker runs, but its heartbeat has not reached Redis within the ttl %s", h.owner.ttl)
		return checkResult{OK: false, Shared: true, Detail: detail}
	}
	return okResult(detail)
}

// clear deletes this instance's heartbeat keys: a clean stop is not a crash, so
// nobody should have to wait for the TTL to see the worker gone.
func (hs *heartbeats) clear(ctx context.Context) error {
	hs.mu.Lock()
	keys := make([]string, 0, len(hs.handles))
	for _, h := range hs.handles {
		keys = append(keys, h.key)
	}
	hs.mu.Unlock()
	if len(keys) == 0 {
		return nil
	}
	if err := hs.rdb.Del(ctx, keys...).Err(); err != nil {
		return fmt.Errorf("deleting heartbeat keys: %w", err)
	}
	return nil
}

// heartbeatAgeCollector exports kumiko_worker_heartbeat_age_seconds{worker},
// computed at scrape time so a stuck worker's age keeps growing.
type heartbeatAgeCollector struct{ hs *heartbeats }

var heartbeatAgeDesc = prometheus.NewDesc(prometheus.BuildFQName(metricNamespace, "", "worker_heartbeat_age_seconds"),
	"Seconds since this instance's worker last wrote its heartbeat.", []string{"worker"}, nil)

func (c heartbeatAgeCollector) Describe(ch chan<- *prometheus.Desc) { ch <- heartbeatAgeDesc }

func (c heartbeatAgeCollector) Collect(ch chan<- prometheus.Metric) {
	c.hs.mu.Lock()
	defer c.hs.mu.Unlock()
	for _, h := range c.hs.handles {
		if age, ok := h.age(); ok {
			ch <- prometheus.MustNewConstMetric(heartbeatAgeDesc, prometheus.GaugeValue, age.Seconds(), h.worker)
		}
	}
}

// liveWorker is one heartbeat key found in Redis, from any instance.
type liveWorker struct {
	Worker     string `json:"worker"`
	InstanceID string `json:"instanceId"`
	AgeSec     int64  `json:"ageSec"`
}

// listLiveWorkers reads every heartbeat key: the workers alive across all
// instances right now (expired keys are gone by themselves).
func listLiveWorkers(ctx context.Context, rdb *redis.Client) ([]liveWorker, error) {
	// A beat's value is Redis's clock (beatScript): its age is measured on it too.
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("reading the Redis clock: %w", err)
	}
	var workers []liveWorker
	iter := rdb.Scan(ctx, 0, heartbeatKeyPrefix+"*", 100).Iterator()
	for iter.Next(ctx) {
		key := iter.Val()
		worker, instance, ok := strings.Cut(strings.TrimPrefix(key, heartbeatKeyPrefix), ":")
		if !ok {
			continue
		}
		raw, err := rdb.Get(ctx, key).Result()
		if err == redis.Nil {
			continue // expired between SCAN and GET
		}
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", key, err)
		}
		ts, _ := strconv.ParseInt(raw, 10, 64)
		workers = append(workers, liveWorker{Worker: worker, InstanceID: instance, AgeSec: max(0, now.Unix()-ts)})
	}
	if err := iter.Err(); err != nil {
		return nil, fmt.Errorf("scanning heartbeat keys: %w", err)
	}
	return workers, nil
}

// heartbeatMetrics is what the heartbeats add to /metrics (the beats' ages are heartbeatAgeCollector's).
type heartbeatMetrics struct {
	registry prometheus.Registerer // the ages' collector joins it with the heartbeats
	written  *prometheus.CounterVec
}

// newHeartbeatMetrics starts the series of every worker among components at 0.
func newHeartbeatMetrics(r prometheus.Registerer, components []component) *heartbeatMetrics {
	f := promauto.With(r)
	m := &heartbeatMetrics{registry: r,
		written: f.NewCounterVec(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "worker_heartbeats_total", Help: "Heartbeats written to Redis, by worker and result.",
		}, []string{"worker", "result"}),
	}
	for _, c := range components {
		if c.heartbeat != "" {
			for _, result := range []string{"ok", "failed"} {
				m.written.WithLabelValues(c.heartbeat, result)
			}
		}
	}
	return m
}
