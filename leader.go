package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// componentLeaderElection is the leader elector.
var componentLeaderElection = component{name: "leaderElection", connects: true}

// leaderElectionConfig is the leader election's settings.
type leaderElectionConfig struct {
	Enabled       bool
	LockTTL       time.Duration
	RenewInterval time.Duration
}

func (c *leaderElectionConfig) settings() []configSetting {
	return []configSetting{
		{key: "lifecycle.leaderElection.enabled", env: "KUMIKO_LEADER_ENABLED", def: "true", value: boolValue{p: &c.Enabled},
			doc: "elect one leader to schedule the cron jobs"},
		{key: "lifecycle.leaderElection.lockTtl", env: "KUMIKO_LEADER_LOCK_TTL", def: "15s", value: durationValue{p: &c.LockTTL},
			doc: "the leader lock expires this long after its last renewal", old: "lifecycle.leaderElection.lockTtlSec"},
		{key: "lifecycle.leaderElection.renewInterval", env: "KUMIKO_LEADER_RENEW_INTERVAL", def: "5s", value: durationValue{p: &c.RenewInterval},
			doc: "the leader renews its lock this often (four times as often after a failed renewal); it steps down one interval before the lock can expire, so at most lockTtl/2.2", old: "lifecycle.leaderElection.heartbeatIntervalSec"},
	}
}

// validate: the leader steps down one renew interval before its lock can
// expire: its renew deadline is lockTtl − renewInterval, and, as client-go's
// leaderelection requires, it must exceed 1.2 renew intervals, or the
// leader steps down before it ever renews.
func (c *leaderElectionConfig) validate() []error {
	return rule(!c.Enabled || 5*(c.LockTTL-c.RenewInterval) > 6*c.RenewInterval,
		"lifecycle.leaderElection: the renew deadline, lockTtl − renewInterval (%s − %s), must exceed 1.2 × renewInterval, "+
			"or the leader steps down before it ever renews its lock (renewInterval at most lockTtl/2.2)", c.LockTTL, c.RenewInterval)
}

// renewScript extends the lock only if this instance still holds it: a plain
// SET XX would extend the lock of whoever holds it now.
var renewScript = redis.NewScript(`
if redis.call("GET", KEYS[1]) == ARGV[1] then
	return redis.call("PEXPIRE", KEYS[1], ARGV[2])
end
return 0`)

// drawScript draws a fencing token that is larger than the fence the
// database holds (ARGV[1]): a Redis that lost its data (FLUSHALL, a restart
// without persistence, a failover to a replica that missed the last INCR)
// would otherwise hand out tokens the fence refuses forever. It returns the
// token and 1 when the counter had to be raised.
var drawScript = redis.NewScript(`
local floor = tonumber(ARGV[1])
local cur = tonumber(redis.call("GET", KEYS[1]) or "0")
local raised = 0
if cur < floor then
	redis.call("SET", KEYS[1], floor)
	raised = 1
end
return {redis.call("INCR", KEYS[1]), raised}`)

// elector keeps one leader among all instances with a Redis TTL lock. While
// this instance leads, lead runs with a context that ends the moment it stops
// leading — lost lock, missed renew deadline or shutdown. Nothing else can ask
// "am I leader": exclusive work lives inside lead. When lead returns a
// *fencedError (the database knows a newer token) the elector steps down,
// releases the lock and acquires again with a token drawn above the fence.
//
// Its Stop (from startStop, stopSoft) ends leadership — lead returns, the lock
// is deleted with a compare-and-DEL, followers are told at once — and waits.
//
// The lock's calls (the token, the SETNX, the renewals) go through a client
// of the elector's own, for two reasons. A slow Redis times out the 1 s calls
// of the other loops (heartbeats, the dashboard record); each timeout closes
// its connection, and a new one costs four round trips before its first
// command: 4.8 s at 1.2 s of latency, which a renewal sharing their pool paid
// every time, and lost the lock over. And a stop closes that client, which
// ends a call in flight at once: go-redis ends a call at its deadline or when
// its connection closes, never when its context is cancelled. So a renewal
// may take until the renew deadline and a try at the lock as long as the
// lock lives, and a stop still waits for neither.
type elector struct {
	*startStop
	rdb        *redis.Client
	lockOpts   *redis.Options // the elector's own client's; rdb, the instance's, reads and releases
	instanceID string
	ttl, renew time.Duration
	lead       func(ctx context.Context, token int64) error
	fence      func(ctx context.Context) (int64, error) // the token the database holds now
	retry      time.Duration                            // leaderRenewRetry: after a failed renewal
	release    time.Duration                            // a release of the lock: shutdown, fence, a SETNX cut short
	log        *logrus.Entry
	metrics    *leaderMetrics

	mu          sync.Mutex
	releaseErr  error // the shutdown's release failed: the lock expires by itself
	leading     bool
	fenced      bool      // fenced and not yet leading again with a valid token
	lastFenced  time.Time // for the readiness body
	fencedTotal int
}

// electorDeps is what newElector builds an elector from.
type electorDeps struct {
	redis      *redis.Client
	redisOpts  *redis.Options // REDIS_URL's, for the elector's own client
	instanceID string
	ttl, renew time.Duration // the lock's TTL and how often it is renewed
	timeouts   timeouts
	lead       func(ctx context.Context, token int64) error
	fence      func(ctx context.Context) (int64, error)
	log        *logrus.Logger
	metrics    *leaderMetrics
	onPanic    func(c component, recovered any)
}

func newElector(d electorDeps) *elector {
	return &elector{startStop: newStartStop(componentLeaderElection, stopSoft, d.onPanic),
		rdb: d.redis, lockOpts: lockClientOptions(d.redisOpts), instanceID: d.instanceID, ttl: d.ttl, renew: d.renew,
		lead: d.lead, fence: d.fence, retry: d.timeouts.leaderRenewRetry, release: d.timeouts.redisRelease,
		log: componentLeaderElection.log(d.log), metrics: d.metrics}
}

// lockClientOptions are REDIS_URL's options for the elector's own client,
// named so that CLIENT LIST tells its connections from the instance's.
func lockClientOptions(instance *redis.Options) *redis.Options {
	opts := *instance
	opts.ClientName += "/leaderElection"
	return &opts
}

// Stop ends leadership and waits (startStop); a lock it could not release is
// a best-effort failure: followers take over when it expires.
func (e *elector) Stop(ctx context.Context) error {
	if err := e.startStop.Stop(ctx); err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.releaseErr != nil {
		return &bestEffortError{err: e.releaseErr}
	}
	return nil
}

// Start checks Redis synchronously, then starts the election loop.
func (e *elector) Start(ctx context.Context) error {
	return e.start(ctx, func(ctx context.Context) error {
		if err := e.rdb.Ping(ctx).Err(); err != nil {
			return fmt.Errorf("leader election needs Redis: %w", err)
		}
		return nil
	}, e.run)
}

// run tries to lead until the elector stops.
func (e *elector) run(ctx context.Context) {
	lock := redis.NewClient(e.lockOpts)
	defer lock.Close()
	// Followers hear a release at once instead of at their next try.
	released := e.rdb.Subscribe(ctx, leaderReleased)
	defer released.Close()
	wake := released.Channel()

	// An acquisition or renewal in flight ends when the stop begins: a stop
	// must not wait for a slow Redis. The database's fence read ends with
	// calls, Redis's calls with the lock's client. The lock is released
	// right after, on the instance's client (a SETNX cut short is undone in
	// acquire).
	stopping := e.stopping()
	calls, cancelCalls := context.WithCancel(ctx)
	defer cancelCalls()
	watch := e.goOwned(ctx, func(ctx context.Context) {
		select {
		case <-stopping:
			cancelCalls()
			lock.Close()
		case <-ctx.Done():
		}
	})
	defer watch.stop()

	tick := time.NewTicker(e.renew)
	defer tick.Stop()
	for {
		token, value, sent, ok := e.acquire(calls, lock)
		if ok {
			e.serve(ctx, calls, stopping, lock, token, value, sent)
		}
		select {
		case <-stopping: // first: a tick that is also due must not start another acquisition
			return
		default:
		}
		select {
		case <-stopping:
			return
		case <-wake:
		case <-tick.C:
		}
	}
}

// acquire tries to take the lock. The fencing token is drawn first, above
// the fence the database holds, so every acquisition carries a larger token
// than any leader before it, even after Redis lost its counter. A try takes
// a few round trips and may take as long as the lock would live: a Redis
// slower than that elects nobody. sent is when the SETNX was sent: the
// lock's TTL runs from no earlier.
func (e *elector) acquire(ctx context.Context, lock *redis.Client) (token int64, value string, sent time.Time, ok bool) {
	stopped := ctx
	ctx, cancel := context.WithTimeout(ctx, e.ttl)
	defer cancel()
	floor, err := e.fence(ctx)
	if stopped.Err() != nil {
		return 0, "", time.Time{}, false
	}
	if err != nil {
		// Without the fence a token may be stale; the scheduler cannot work
		// without the database anyway.
		e.log.WithError(err).Warn("reading the fencing token from the database")
		return 0, "", time.Time{}, false
	}
	res, err := drawScript.Run(ctx, lock, []string{leaderTokenKey}, floor).Int64Slice()
	if stopped.Err() != nil {
		return 0, "", time.Time{}, false
	}
	if err != nil || len(res) != 2 {
		e.log.WithError(err).Warn("drawing a fencing token")
		return 0, "", time.Time{}, false
	}
	token = res[0]
	if res[1] == 1 {
		e.markFenced(floor, "the Redis token counter was behind the database fence (Redis lost its data): raised it")
	}
	value = e.instanceID + ":" + strconv.FormatInt(token, 10)
	sent = time.Now()
	ok, err = lock.SetNX(ctx, leaderKey, value, e.ttl).Result()
	switch {
	case err != nil:
		if stopped.Err() == nil {
			e.log.WithError(err).Warn("trying the leader lock")
		}
		// A SETNX that timed out or was cut short may still have been
		// applied: this instance would hold a lock it does not know of. Only
		// its own value is deleted.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.release)
		defer cancel()
		compareAndDelete.Run(rctx, e.rdb, []string{leaderKey}, value)
	case !ok:
		e.setFenced(false) // another instance leads; nothing to fix here
	}
	return token, value, sent, ok
}

// markFenced records that this instance met a fence newer than its token:
// one log line, the metrics and the readiness body say so.
func (e *elector) markFenced(fence int64, reason string) {
	e.mu.Lock()
	e.lastFenced = time.Now()
	e.fencedTotal++
	e.mu.Unlock()
	e.setFenced(true)
	e.metrics.fencedTotal.Inc()
	e.log.WithFields(logrus.Fields{"event": "fenced", "fence": fence, "reason": reason}).Warn("fenced")
}

// setFenced sets kumiko_leader_fenced: 1 from a fencing until this instance
// leads again with a token drawn above the fence, or sees another instance lead.
func (e *elector) setFenced(fenced bool) {
	e.mu.Lock()
	e.fenced = fenced
	e.mu.Unlock()
	e.metrics.fenced.Set(boolGauge(fenced))
}

// serve leads until the lock is lost, the renew deadline passes or the
// elector stops. As in client-go's leaderelection: the lock lives lockTtl
// from the last renewal sent (acquired: the SETNX); the leader renews every
// renewInterval, counted from when the last renewal was sent, so a slow one
// does not push the next back, and, after a renewal failed, retries four
// times as often; its renew deadline is one renewInterval before the lock
// can expire, and past it this instance stops acting, before anyone else can
// take over. A renewal may take until that deadline, so a slow Redis keeps
// its leader. Config validation keeps renewInterval ≤ lockTtl/2.2: at least
// two renewals fit before the deadline. Renewals run on lock, which the stop
// closes.
func (e *elector) serve(ctx, calls context.Context, stopping <-chan struct{}, lock *redis.Client, token int64, value string, acquired time.Time) {
	log := e.log.WithField("fencing_token", token)
	e.setLeading(true)
	// The token was drawn above the fence: leading with it ends a fencing
	// (a newer fence met later sets it again).
	e.setFenced(false)
	log.Info("became leader")
	var leadErr error // written by lead's goroutine, read after it returned
	leading := e.goOwned(ctx, func(ctx context.Context) { leadErr = e.lead(ctx, token) })

	deadline := acquired.Add(e.ttl - e.renew)
	stepDown := time.NewTimer(time.Until(deadline))
	defer stepDown.Stop()
	renew := time.NewTimer(time.Until(acquired.Add(e.renew)))
	defer renew.Stop()
	reason := ""
	for reason == "" {
		select {
		case <-stopping:
			reason = "shutdown"
		case <-leading.done: // lead gave up on its own: only a fence makes it
			reason = "fenced"
		case <-stepDown.C:
			reason = "renew deadline passed"
		case <-renew.C:
			sent := time.Now()
			if sent.After(deadline) { // woke late (e.g. the process was paused)
				reason = "renew deadline passed"
				break
			}
			// Bounded by the step-down deadline, so a renewal in flight can
			// never keep this instance leading past it.
			rctx, cancel := context.WithDeadline(calls, deadline)
			n, err := renewScript.Run(rctx, lock, []string{leaderKey}, value, e.ttl.Milliseconds()).Int()
			cancel()
			switch {
			case calls.Err() != nil: // stopping: the next select says so
			case err != nil:
				log.WithError(err).Warn("renewing the leader lock")
				renew.Reset(e.retry)
			case n == 0:
				reason = "lock lost"
			default:
				deadline = sent.Add(e.ttl - e.renew)
				stepDown.Reset(time.Until(deadline))
				renew.Reset(time.Until(sent.Add(e.renew)))
			}
		}
	}

	leading.stop()
	e.setLeading(false)
	log.WithField("reason", reason).Info("stopped leading")
	if fe := (*fencedError)(nil); errors.As(leadErr, &fe) {
		e.markFenced(fe.fence, "a newer leader's token is in the database: stepped down to acquire a new one")
	}
	// After a shutdown or a fence the lock is released at once, so the next
	// leader (this instance again, after a fence) need not wait for the TTL.
	if reason == "shutdown" || reason == "fenced" {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.release)
		defer cancel()
		n, err := compareAndDelete.Run(rctx, e.rdb, []string{leaderKey}, value).Int()
		if err == nil && n == 1 {
			err = e.rdb.Publish(rctx, leaderReleased, e.instanceID).Err()
		}
		if err != nil && reason == "shutdown" {
			e.mu.Lock()
			e.releaseErr = fmt.Errorf("releasing the leader lock: %w", err)
			e.mu.Unlock()
		}
	}
}

func (e *elector) setLeading(leading bool) {
	e.mu.Lock()
	changed := e.leading != leading
	e.leading = leading
	e.mu.Unlock()
	if changed {
		e.metrics.leading.Set(boolGauge(leading))
		e.metrics.transitions.Inc()
	}
}

// readinessCheck is the schedulerLeader check: who leads, whether this
// instance does, and whether it was fenced (and when last).
func (e *elector) readinessCheck(ctx context.Context) checkResult {
	e.mu.Lock()
	detail := map[string]any{"isLeader": e.leading, "fenced": e.fenced, "fencedTotal": e.fencedTotal}
	if !e.lastFenced.IsZero() {
		detail["lastFencedAt"] = e.lastFenced.UTC().Format(time.RFC3339)
	}
	e.mu.Unlock()
	leader, err := currentLeader(ctx, e.rdb)
	if err != nil {
		return failedResult(err, detail)
	}
	detail["leader"] = leader
	return okResult(detail)
}

// currentLeader reads who holds the lock (for the readiness body and /admin/workers).
func currentLeader(ctx context.Context, rdb *redis.Client) (string, error) {
	v, err := rdb.Get(ctx, leaderKey).Result()
	if errors.Is(err, redis.Nil) {
		return "", nil
	}
	id, _, _ := strings.Cut(v, ":")
	return id, err
}

// fencedError means a newer leader's token is in the database: this leader
// must not act, and steps down to acquire a new token.
type fencedError struct{ token, fence int64 }

func (e *fencedError) Error() string {
	return fmt.Sprintf("fenced: token %d is older than the fence %d of a newer leader", e.token, e.fence)
}

// leaderMetrics is what the leader election adds to /metrics.
type leaderMetrics struct {
	leading     prometheus.Gauge
	transitions prometheus.Counter
	fenced      prometheus.Gauge
	fencedTotal prometheus.Counter
}

func newLeaderMetrics(r prometheus.Registerer) *leaderMetrics {
	f := promauto.With(r)
	return &leaderMetrics{
		leading: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "leader", Help: "1 while this instance leads (schedules the cron jobs).",
		}),
		transitions: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "leader_transitions_total", Help: "Times this instance became or stopped being leader.",
		}),
		fenced: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "leader_fenced", Help: "1 while this instance is fenced: it met a newer fencing token and does not lead with a valid one yet.",
		}),
		fencedTotal: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "leader_fenced_total", Help: "Times this instance met a fence: a stale token refused, or a token counter behind the fence raised.",
		}),
	}
}
