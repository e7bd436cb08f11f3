package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/robfig/cron/v3"
	"github.com/sirupsen/logrus"
)

const (
	leaderKey      = "lifecycle:leader"          // value: "<instanceId>:<fencing token>"
	leaderTokenKey = "lifecycle:leader:fencing"  // INCR on every acquisition
	leaderReleased = "lifecycle:leader:released" // pub/sub: the leader stepped down, try now
)

// renewScript extends the lock only if this instance still holds it: a plain
// SET XX would extend the lock of whoever holds it now.
var renewScript = redis.NewScript(`
if redis.call("GET", KEYS[1]) == ARGV[1] then
	return redis.call("PEXPIRE", KEYS[1], ARGV[2])
end
return 0`)

// releaseScript deletes the lock only if this instance still holds it.
var releaseScript = redis.NewScript(`
if redis.call("GET", KEYS[1]) == ARGV[1] then
	return redis.call("DEL", KEYS[1])
end
return 0`)

// elector keeps one leader among all instances with a Redis TTL lock. While
// this instance leads, lead runs with a context that ends the moment it stops
// leading — lost lock, missed renew deadline or shutdown. Nothing else can ask
// "am I leader": exclusive work lives inside lead.
type elector struct {
	rdb        *redis.Client
	instanceID string
	ttl, renew time.Duration
	lead       func(ctx context.Context, token int64)
	log        *logrus.Entry
	metrics    *metrics
	onPanic    func(any)

	mu       sync.Mutex
	leading  bool
	stopping chan struct{}
	done     chan struct{}
}

func newElector(rdb *redis.Client, instanceID string, ttl, renew time.Duration, lead func(context.Context, int64),
	log *logrus.Logger, m *metrics, onPanic func(any)) *elector {
	return &elector{rdb: rdb, instanceID: instanceID, ttl: ttl, renew: renew, lead: lead,
		log: log.WithField("component", "leader"), metrics: m, onPanic: onPanic}
}

// Start checks Redis synchronously, then starts the election loop.
func (e *elector) Start(ctx context.Context) error {
	if e.done != nil {
		return errors.New("elector already started")
	}
	if err := e.rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("leader election needs Redis: %w", err)
	}
	e.stopping, e.done = make(chan struct{}), make(chan struct{})
	go e.run()
	return nil
}

// Stop ends leadership (lead returns, the lock is deleted with a
// compare-and-DEL, followers are told at once) and waits, within ctx.
func (e *elector) Stop(ctx context.Context) error {
	if e.done == nil {
		return nil
	}
	e.mu.Lock()
	select {
	case <-e.stopping:
	default:
		close(e.stopping)
	}
	e.mu.Unlock()
	select {
	case <-e.done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("leader election did not stop: %w", context.Cause(ctx))
	}
}

// isLeader is for the readiness body and metrics only.
func (e *elector) isLeader() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.leading
}

func (e *elector) run() {
	defer close(e.done)
	defer func() {
		if r := recover(); r != nil {
			e.onPanic(r)
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	// Followers hear a release at once instead of at their next try.
	released := e.rdb.Subscribe(ctx, leaderReleased)
	defer released.Close()
	wake := released.Channel()

	tick := time.NewTicker(e.renew)
	defer tick.Stop()
	for {
		token, value, ok := e.acquire(ctx)
		if ok {
			e.serve(ctx, token, value)
		}
		select {
		case <-e.stopping:
			return
		case <-wake:
		case <-tick.C:
		}
	}
}

// acquire tries to take the lock. The fencing token is drawn first, so every
// acquisition carries a larger token than any before it.
func (e *elector) acquire(ctx context.Context) (token int64, value string, ok bool) {
	token, err := e.rdb.Incr(ctx, leaderTokenKey).Result()
	if err != nil {
		e.log.WithError(err).Warn("drawing a fencing token")
		return 0, "", false
	}
	value = e.instanceID + ":" + strconv.FormatInt(token, 10)
	ok, err = e.rdb.SetNX(ctx, leaderKey, value, e.ttl).Result()
	if err != nil {
		e.log.WithError(err).Warn("trying the leader lock")
	}
	return token, value, ok
}

// serve leads until the lock is lost, the renew deadline passes or the
// elector stops. The deadline is when this instance must stop acting: one
// renew interval before the key could expire, counted from when the last
// successful renewal was sent, so a leader cut off from Redis steps down
// before anyone else can take over.
func (e *elector) serve(ctx context.Context, token int64, value string) {
	log := e.log.WithField("fencing_token", token)
	leadCtx, stopLeading := context.WithCancel(ctx)
	led := make(chan struct{})
	e.setLeading(true)
	log.Info("became leader")
	go func() {
		defer close(led)
		defer func() {
			if r := recover(); r != nil {
				e.onPanic(r)
			}
		}()
		e.lead(leadCtx, token)
	}()

	deadline := time.Now().Add(e.ttl - e.renew)
	renew := time.NewTicker(e.renew)
	defer renew.Stop()
	reason := ""
	for reason == "" {
		select {
		case <-e.stopping:
			reason = "shutdown"
		case <-time.After(time.Until(deadline)):
			reason = "renew deadline passed"
		case <-renew.C:
			if time.Now().After(deadline) { // woke late (e.g. the process was paused)
				reason = "renew deadline passed"
				break
			}
			sent := time.Now()
			n, err := renewScript.Run(ctx, e.rdb, []string{leaderKey}, value, e.ttl.Milliseconds()).Int()
			switch {
			case err != nil:
				log.WithError(err).Warn("renewing the leader lock")
			case n == 0:
				reason = "lock lost"
			default:
				deadline = sent.Add(e.ttl - e.renew)
			}
		}
	}

	stopLeading()
	<-led
	e.setLeading(false)
	log.WithField("reason", reason).Info("stopped leading")
	if reason == "shutdown" {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), e.renew)
		defer cancel()
		if n, err := releaseScript.Run(rctx, e.rdb, []string{leaderKey}, value).Int(); err == nil && n == 1 {
			e.rdb.Publish(rctx, leaderReleased, e.instanceID)
		}
	}
}

func (e *elector) setLeading(leading bool) {
	e.mu.Lock()
	changed := e.leading != leading
	e.leading = leading
	e.mu.Unlock()
	if changed {
		e.metrics.leader.Set(boolGauge(leading))
		e.metrics.leaderTransitions.Inc()
	}
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

// ---------------------------------------------------------------------------
// The cron scheduler: it runs only inside elector.lead.

// cronParser accepts standard 5-field specs, an optional seconds field, and
// descriptors such as @hourly or @every 10s.
var cronParser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// scheduler enqueues the report at every tick of its schedule while this
// instance leads. Each tick is inserted with a unique key (the tick's time)
// in a transaction that first checks the fencing token against the database,
// so neither two leaders nor a stale one can enqueue a tick twice.
type scheduler struct {
	db       *pgxpool.Pool
	jobs     *jobs
	schedule cron.Schedule
	beat     *heartbeat
	beatInt  time.Duration
	log      *logrus.Entry
}

// errFenced means a newer leader exists: this one must not act.
var errFenced = errors.New("fenced: a newer leader holds a larger token")

// lead is elector.lead. Policy for missed ticks: on taking over, the newest
// tick of the last interval is enqueued (a no-op when the previous leader
// did); older missed ticks are not — a report is about now, not a backlog.
func (s *scheduler) lead(ctx context.Context, token int64) {
	log := s.log.WithField("fencing_token", token)
	// Raise the fence first: from now on a stale leader's inserts are refused.
	if _, err := s.db.Exec(ctx, `UPDATE scheduler_fence SET token = $1 WHERE token < $1`, token); err != nil && ctx.Err() == nil {
		log.WithError(err).Warn("raising the fencing token")
	}
	beat := time.NewTicker(s.beatInt)
	defer beat.Stop()
	s.heartbeat(ctx)
	if prev, ok := previousTick(s.schedule, time.Now()); ok {
		s.enqueue(ctx, log, token, prev)
	}
	for {
		next := s.schedule.Next(time.Now())
		timer := time.NewTimer(time.Until(next))
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-beat.C:
			timer.Stop()
			s.heartbeat(ctx)
		case <-timer.C:
			s.enqueue(ctx, log, token, next)
		}
	}
}

func (s *scheduler) heartbeat(ctx context.Context) {
	if err := s.beat.beat(ctx); err != nil && ctx.Err() == nil {
		s.log.WithError(err).Warn("scheduler heartbeat")
	}
}

func (s *scheduler) enqueue(ctx context.Context, log *logrus.Entry, token int64, tick time.Time) {
	tick = tick.UTC()
	err := pgx.BeginFunc(ctx, s.db, func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, `UPDATE scheduler_fence SET token = $1 WHERE token <= $1`, token)
		if err != nil {
			return err
		}
		if tag.RowsAffected() == 0 {
			return errFenced
		}
		res, err := s.jobs.client.InsertTx(ctx, tx, reportArgs{ScheduledAt: tick, FencingToken: token}, nil)
		if err == nil && res.UniqueSkippedAsDuplicate {
			log.WithField("tick", tick).Debug("tick already enqueued")
		}
		return err
	})
	switch {
	case errors.Is(err, errFenced):
		log.WithField("tick", tick).Warn("refusing to enqueue: a newer leader exists")
	case err != nil && ctx.Err() == nil:
		log.WithField("tick", tick).WithError(err).Warn("enqueueing the report")
	}
}

// previousTick is the newest tick at or before now, if it lies within one
// interval of the schedule.
func previousTick(s cron.Schedule, now time.Time) (time.Time, bool) {
	next := s.Next(now)
	interval := s.Next(next).Sub(next)
	var prev time.Time
	for t := s.Next(now.Add(-interval - time.Second)); !t.After(now); t = s.Next(t) {
		prev = t
	}
	return prev, !prev.IsZero()
}
