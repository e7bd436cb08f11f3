package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgxlisten"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promauto"
	"github.com/redis/go-redis/v9"
	"github.com/riverqueue/river"
	"github.com/sirupsen/logrus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// componentOutboxPoller is the outbox poller.
var componentOutboxPoller = component{name: "outboxPoller", heartbeat: "outbox", gates: true, connects: true}

// outboxConfig is the outbox block's settings.
type outboxConfig struct {
	BatchSize    uint
	PollInterval time.Duration
	Listen       bool
	MaxAttempts  uint
	RetryBase    time.Duration
	RetryMax     time.Duration
	Retention    time.Duration
	PurgeCron    string
}

func (c *outboxConfig) settings() []configSetting {
	return []configSetting{
		{key: "outbox.batchSize", env: "KUMIKO_OUTBOX_BATCH_SIZE", def: "100", value: uintValue{p: &c.BatchSize, min: 1, max: 10000},
			doc: "events claimed and delivered per transaction"},
		{key: "outbox.pollInterval", env: "KUMIKO_OUTBOX_POLL_INTERVAL", def: "1s", value: durationValue{p: &c.PollInterval},
			doc: "fallback when no NOTIFY wakes the poller", old: "outbox.pollIntervalSec"},
		{key: "outbox.listen", env: "KUMIKO_OUTBOX_LISTEN", def: "true", value: boolValue{p: &c.Listen},
			doc: "LISTEN/NOTIFY wake-ups; false behind PgBouncer in transaction mode"},
		{key: "outbox.maxAttempts", env: "KUMIKO_OUTBOX_MAX_ATTEMPTS", def: "10", value: uintValue{p: &c.MaxAttempts, min: 1},
			doc: "failed deliveries before an event is dead (dead_at)"},
		{key: "outbox.retryBase", env: "KUMIKO_OUTBOX_RETRY_BASE", def: "1s", value: durationValue{p: &c.RetryBase},
			doc: "first delay after a failed delivery; doubles", old: "outbox.retryBaseSec"},
		{key: "outbox.retryMax", env: "KUMIKO_OUTBOX_RETRY_MAX", def: "5m", value: durationValue{p: &c.RetryMax},
			doc: "cap on that delay", old: "outbox.retryMaxSec"},
		{key: "outbox.retention", env: "KUMIKO_OUTBOX_RETENTION", def: "168h", value: durationValue{p: &c.Retention},
			doc: "delivered events older than this (7 days) are deleted; pending and dead ones are kept", old: "outbox.retentionSec"},
		{key: "outbox.purgeCron", env: "KUMIKO_OUTBOX_PURGE_CRON", def: "@hourly", value: textValue{p: &c.PurgeCron},
			doc: "when the leader enqueues the retention job (purgeOutbox)"},
	}
}

func (c *outboxConfig) validate() []error {
	return rule(c.RetryBase <= c.RetryMax, "outbox.retryBase (%s) must not exceed retryMax (%s)", c.RetryBase, c.RetryMax)
}

const (
	// outboxNotifyChannel is the Postgres channel the insert trigger notifies.
	outboxNotifyChannel = "outbox_events"
	// outboxDeliveryLock is the advisory lock a sequencer step holds from
	// taking its sequence numbers until it commits (see migration 2).
	outboxDeliveryLock = advisoryLockKey
	// sequencerBatch bounds the events one sequencer step numbers.
	sequencerBatch = 5000
)

// outboxEvent is one event as delivered: its outbox id (the id SSE clients
// see and dedupe by) and its place in the delivery order.
type outboxEvent struct {
	ID            int64           `json:"id"`
	Seq           int64           `json:"seq"`
	Type          string          `json:"type"`
	AggregateType string          `json:"aggregateType"`
	AggregateID   string          `json:"aggregateId"`
	Payload       json.RawMessage `json:"payload"`
	CreatedAt     time.Time       `json:"createdAt"`
	Traceparent   string          `json:"-"` // the writer's trace, continued by delivery and jobs
}

// writeOutboxEvent records an event in the caller's transaction, so the
// business row and its event commit, or roll back, together. The payload is
// public: GET /api/events shows it to anyone, so it carries only what anyone
// may read; a subscriber loads the rest by aggregateID, which stays inside.
func writeOutboxEvent(ctx context.Context, tx rowQuerier, aggregateType, aggregateID, eventType string, payload any) (int64, error) {
	body, err := json.Marshal(payload)
	if err != nil {
		return 0, fmt.Errorf("encoding the %s payload: %w", eventType, err)
	}
	var id int64
	err = tx.QueryRow(ctx, `INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, traceparent)
		VALUES ($1, $2, $3, $4, NULLIF($5, '')) RETURNING id`, aggregateType, aggregateID, eventType, body, traceparentOf(ctx)).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("writing the %s event: %w", eventType, err)
	}
	return id, nil
}

// rowQuerier is a transaction, or a pool for a statement that is a
// transaction of its own.
type rowQuerier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// outboxPoller delivers its instance's share of the outbox (outboxShare):
// it claims due rows of its partitions with FOR UPDATE SKIP LOCKED, inserts
// the jobs they trigger and marks them delivered in one transaction; every
// instance delivers at once. A sequencer step then gives the delivered events
// their delivery_seq, one step at a time cluster-wide, and wakes the SSE hubs
// over Redis (docs/delivery.md). An insert wakes the poller (LISTEN/NOTIFY);
// a slow poll is the fallback. Failed deliveries back off exponentially and
// die after a maximum. Rows a crashed poller held are picked again by the
// next owner of their partition: their transaction died with its connection.
//
// Its Stop (from startStop, stopSoft) lets the batch in hand finish and picks
// no new one; when Stop's ctx ends first the batch is cancelled: its
// transaction rolls back and the rows stay pending for the next poller.
type outboxPoller struct {
	*startStop
	db      *pgxpool.Pool
	rdb     *redis.Client
	cfg     outboxConfig
	beat    *heartbeat
	beatInt time.Duration
	log     *logrus.Entry
	metrics *outboxMetrics
	// alsoInTx inserts the jobs the events trigger, in the delivery
	// transaction (in a savepoint: an error fails only those events).
	alsoInTx func(ctx context.Context, tx pgx.Tx, events []outboxEvent) error
	share    *outboxShare

	wake     chan struct{}    // buffered 1: "there may be new rows"
	sequence chan struct{}    // buffered 1: "there may be delivered rows to number", for runSequencer
	wakeQ    chan outboxEvent // buffered 1: the newest numbered event, for runWaker
}

// stopLosingNothing is the poller's release hook: Stop, where a hard stop
// loses nothing. A batch the drain's share could not finish (a slow shared
// database) rolled back, and its events stay pending for the next poller:
// the step is logged as failed, but it does not turn the exit code to 1.
// Neither do goroutines that outlived the hard stop's short grace (seen on a
// machine with a load of 27: the listener had not yet been scheduled to
// see its cancel): the step logs them and the diagnostics dump where they
// were, which is what tells a hang from a late return.
func (p *outboxPoller) stopLosingNothing(ctx context.Context) error {
	err := p.Stop(ctx)
	switch {
	case errors.Is(err, errStoppedHard):
		return &bestEffortError{err: fmt.Errorf("%w; the batch in hand rolled back and its events stay pending", err)}
	case errors.Is(err, errStillRunning):
		// Cancelled, not yet returned: a delivery commits or rolls back
		// whole, and the db step waits for its connection, bounded.
		return &bestEffortError{err: fmt.Errorf("%w; its batch commits or rolls back whole, nothing is lost", err)}
	}
	return err
}

// outboxPollerDeps is what newOutboxPoller builds a poller from.
type outboxPollerDeps struct {
	db         *pgxpool.Pool
	redis      *redis.Client
	cfg        outboxConfig
	beat       *heartbeat
	beatEvery  time.Duration
	instanceID string
	memberTTL  time.Duration                                                    // a poller that stopped beating loses its share after this (the heartbeat TTL)
	redisCall  time.Duration                                                    // one Redis call of the share
	insertJobs func(ctx context.Context, tx pgx.Tx, events []outboxEvent) error // in the delivery transaction
	log        *logrus.Logger
	metrics    *outboxMetrics
	onPanic    func(c component, recovered any)
}

func newOutboxPoller(d outboxPollerDeps) *outboxPoller {
	log := componentOutboxPoller.log(d.log)
	return &outboxPoller{startStop: newStartStop(componentOutboxPoller, stopSoft, d.onPanic),
		db: d.db, rdb: d.redis, cfg: d.cfg, beat: d.beat, beatInt: d.beatEvery, alsoInTx: d.insertJobs,
		share: newOutboxShare(d.redis, d.instanceID, d.memberTTL, d.redisCall, log),
		log:   log, metrics: d.metrics,
		wake: make(chan struct{}, 1), sequence: make(chan struct{}, 1), wakeQ: make(chan outboxEvent, 1)}
}

// Start checks the outbox synchronously (the table is there, the heartbeat
// can be written), joins the pollers and reads its share, then starts the
// poller goroutine. It returns once started.
func (p *outboxPoller) Start(ctx context.Context) error {
	return p.start(ctx, func(ctx context.Context) error {
		if err := p.updatePending(ctx); err != nil {
			return err
		}
		if err := p.beat.beat(ctx); err != nil {
			return err
		}
		if err := p.share.join(ctx); err != nil {
			return err
		}
		_, err := p.share.refresh(ctx)
		return err
	}, p.run)
}

func (p *outboxPoller) run(ctx context.Context) {
	// Deferred in reverse: after the last batch, the last sequencer step
	// numbers what this poller delivered, then it leaves the pollers (the
	// others take its partitions at once), then the waker stops.
	// The waker publishes after the commits, so Redis never holds a delivery.
	defer p.goOwned(ctx, p.runWaker).stop()
	defer func() {
		if err := p.share.leave(ctx); err != nil && ctx.Err() == nil {
			p.log.WithError(err).Warn("leaving the outbox pollers; the others take this share when its entry expires")
		}
	}()
	defer p.sequenceDelivered(ctx)
	defer p.goOwned(ctx, p.runSequencer).stop()
	// The listener only wakes the loop; if it is down (or off) the poll still delivers.
	if p.cfg.Listen {
		defer p.goOwned(ctx, p.listen).stop()
	}
	defer p.goOwned(ctx, func(ctx context.Context) { p.share.watch(ctx, p.cfg.PollInterval, p.wakeUp) }).stop()

	stopping := p.stopping()
	poll := time.NewTicker(p.cfg.PollInterval)
	defer poll.Stop()
	beat := time.NewTicker(p.beatInt)
	defer beat.Stop()
	for {
		p.deliverDue(ctx, beat.C)
		select {
		case <-stopping:
			return
		case <-p.wake:
		case <-poll.C:
			// Events a crashed poller delivered but did not number wait for
			// any sequencer step: one runs on every poll.
			p.kickSequencer()
		case <-beat.C:
			p.beatNow(ctx)
		}
	}
}

// beatNow writes the heartbeat and refreshes this poller's entry among the
// pollers, both from the delivery loop: a loop that is stuck loses its share.
// It also recounts the pending events: the count reads every pending row, so
// it runs once a beat, not once a poll (with a backlog of 200,000 and four
// pollers polling every 50 ms, the counting cost Postgres more than the
// delivery did). Once the stop has begun it makes no further Redis call: a
// stop waits for one call in flight (backgroundCall), not for a row of them.
// Nor does it after a failed beat: Redis did not answer, and a second call
// waiting out its deadline would only delay the next beat, until a loop
// that is merely waiting on a frozen Redis looked stuck (its heartbeat's
// readiness check); the entry is refreshed at the next beat that succeeds.
func (p *outboxPoller) beatNow(ctx context.Context) {
	beatErr := p.beat.beat(ctx)
	if beatErr != nil && ctx.Err() == nil {
		p.log.WithError(beatErr).Warn("heartbeat")
	}
	select {
	case <-p.stopping():
		return
	default:
	}
	if beatErr == nil {
		if err := p.share.join(ctx); err != nil && ctx.Err() == nil {
			p.log.WithError(err).Warn("refreshing this poller's entry")
		}
	}
	if err := p.updatePending(ctx); err != nil && ctx.Err() == nil {
		p.log.WithError(err).Warn("counting pending events")
	}
}

func (p *outboxPoller) wakeUp() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *outboxPoller) kickSequencer() {
	select {
	case p.sequence <- struct{}{}:
	default:
	}
}

// listen turns NOTIFY outbox_events into wake-ups, reconnecting after an
// outage (and waking the loop then, to catch up on what it missed).
func (p *outboxPoller) listen(ctx context.Context) {
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) {
			return pgx.ConnectConfig(ctx, p.db.Config().ConnConfig.Copy())
		},
		LogError: func(ctx context.Context, err error) {
			if ctx.Err() == nil {
				p.log.WithError(err).Warn("outbox listener")
			}
		},
		ReconnectDelay: p.cfg.PollInterval,
	}
	l.Handle(outboxNotifyChannel, wakeHandler(p.wakeUp))
	l.Listen(ctx)
}

// wakeHandler wakes the poller on every notification and after every
// (re)connect, when notifications may have been missed.
type wakeHandler func()

func (w wakeHandler) HandleNotification(context.Context, *pgconn.Notification, *pgx.Conn) error {
	w()
	return nil
}

func (w wakeHandler) HandleBacklog(context.Context, string, *pgx.Conn) error {
	w()
	return nil
}

// deliverDue delivers batches until no due event is left, the poller is
// asked to stop, or a batch fails. It beats when beat ticks: a long backlog
// must not look like a stuck loop.
func (p *outboxPoller) deliverDue(ctx context.Context, beat <-chan time.Time) {
	for {
		select {
		case <-p.stopping():
			return
		case <-beat:
			p.beatNow(ctx)
		default:
		}
		n, err := p.deliverBatch(ctx)
		if err != nil {
			if ctx.Err() == nil {
				p.log.WithError(err).Warn("delivery failed")
			}
			return
		}
		if n == 0 { // a batch may be short of BatchSize with more to come (claimDue)
			return
		}
	}
}

// deliverBatch claims up to BatchSize due events of this poller's share and
// delivers them in one transaction: the jobs each event triggers are
// inserted, the event is marked delivered, and both commit together; the
// sequencer numbers them after the commit (runSequencer). An event whose
// jobs cannot be inserted (a poison event) is isolated in its own savepoint
// and gets an attempt with backoff (dead after the maximum); the events beside
// it are delivered. Redis is not part of this transaction: after the commit
// the poller only wakes the SSE hubs (wakeHubs), which read the delivered
// events from Postgres, so a Redis outage neither blocks nor duplicates a
// delivery. It returns how many events it claimed.
func (p *outboxPoller) deliverBatch(ctx context.Context) (int, error) {
	tx, err := p.db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("beginning a delivery: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))

	events, attempts, err := claimDue(ctx, tx, p.cfg.BatchSize, p.share.current())
	if err != nil || len(events) == 0 {
		if err == nil {
			err = tx.Commit(ctx)
		}
		return 0, err
	}

	delivered, failed, err := p.deliverInTx(ctx, tx, events, attempts)
	if err == nil {
		err = tx.Commit(ctx)
		if err != nil {
			err = fmt.Errorf("committing the delivery: %w", err)
		}
	}
	if err != nil {
		// Whatever failed (a query, the commit, the connection) counts as an
		// attempt for every claimed event, recorded in a transaction of its
		// own; a hard stop (ctx ended) is not the events' fault and leaves
		// them untouched.
		if ctx.Err() == nil {
			err = p.recordFailure(ctx, events, attempts, err)
		}
		return len(events), err
	}
	p.countOutcomes(delivered, failed, attempts, events, true)
	if len(delivered) > 0 {
		p.kickSequencer()
	}
	return len(events), nil
}

// claimDue locks up to limit due events of the partitions in share, with
// their attempts so far: the oldest of each partition, oldest first. It first
// takes the advisory lock of each partition it can: a partition is delivered
// by one transaction at a time, also while two pollers both think they own
// it, so an aggregate's next events are claimed only after its previous ones
// committed. Partitions another transaction holds are left for this time.
//
// Each partition's pending events are read from the pending index, a few
// more than its fair part of the batch; the oldest limit of those are locked
// by primary key. Any prefix of each partition keeps each aggregate in order.
// Both steps have one plan whatever the statistics say: a fresh table, or a
// sudden backlog in a large one, must not turn a claim into a read of every
// pending row (measured: 80 ms a claim, 3,150 events/s).
//
// The locks are taken in the statement that claims, so the claim's snapshot
// may predate the commit of the partition's previous holder; FOR UPDATE
// rereads every row it locks at its newest version and drops those that no
// longer match, so what that holder delivered is not claimed again.
func claimDue(ctx context.Context, tx pgx.Tx, limit uint, share []int32) ([]outboxEvent, []int32, error) {
	if len(share) == 0 {
		return nil, nil, nil
	}
	perPartition := max(2*((int(limit)+len(share)-1)/len(share)), 16)
	rows, err := tx.Query(ctx, `WITH locked AS MATERIALIZED (
			SELECT p FROM unnest($2::int[]) AS p WHERE pg_try_advisory_xact_lock($3::int, p))
		SELECT id, event_type, aggregate_type, aggregate_id, payload, created_at, attempts, coalesce(traceparent, '')
		FROM outbox_events
		WHERE id = ANY (ARRAY(
				SELECT due.id FROM locked, LATERAL (
					SELECT id FROM outbox_events
					WHERE `+outboxPartitionExpr+` = locked.p
						AND delivered_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
					ORDER BY id LIMIT $4) AS due
				ORDER BY due.id LIMIT $1))
			-- Still pending (FOR UPDATE rechecks it), written so that it
			-- does not match the pending index: on the primary key, the
			-- planner cannot choose to read every pending row instead.
			AND coalesce(delivered_at, dead_at) IS NULL
		ORDER BY id
		FOR UPDATE SKIP LOCKED`, limit, share, outboxPartitionLockClass(), perPartition)
	if err != nil {
		return nil, nil, fmt.Errorf("claiming events: %w", err)
	}
	defer rows.Close()
	var events []outboxEvent
	var attempts []int32
	for rows.Next() {
		var e outboxEvent
		var a int32
		if err := rows.Scan(&e.ID, &e.Type, &e.AggregateType, &e.AggregateID, &e.Payload, &e.CreatedAt, &a, &e.Traceparent); err != nil {
			return nil, nil, fmt.Errorf("reading claimed events: %w", err)
		}
		events, attempts = append(events, e), append(attempts, a)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, fmt.Errorf("claiming events: %w", err)
	}
	return events, attempts, nil
}

// deliverInTx inserts the jobs of the claimed events, then marks the events
// whose jobs exist delivered and gives the others an attempt. It returns the
// delivered events, in order, and the failed ones by index. An error means
// the transaction itself is unusable.
func (p *outboxPoller) deliverInTx(ctx context.Context, tx pgx.Tx, events []outboxEvent, attempts []int32) ([]outboxEvent, map[int]error, error) {
	failed, err := p.insertJobs(ctx, tx, events)
	if err != nil {
		return nil, nil, err
	}
	var delivered []outboxEvent
	for i, e := range events {
		if _, bad := failed[i]; !bad {
			delivered = append(delivered, e)
		}
	}
	if len(delivered) > 0 {
		ids := make([]int64, len(delivered))
		for i := range delivered {
			ids[i] = delivered[i].ID
		}
		if _, err := tx.Exec(ctx, `UPDATE outbox_events SET delivered_at = now(), last_error = NULL WHERE id = ANY ($1::bigint[])`, ids); err != nil {
			return nil, nil, fmt.Errorf("marking events delivered: %w", err)
		}
	}
	if len(failed) > 0 {
		var ids []int64
		var att []int32
		var causes []string
		for i, err := range failed {
			ids, att, causes = append(ids, events[i].ID), append(att, attempts[i]), append(causes, err.Error())
		}
		if err := p.markFailed(ctx, tx, ids, att, causes); err != nil {
			return nil, nil, err
		}
	}
	return delivered, failed, nil
}

// insertJobs inserts the jobs the events trigger. The whole batch is tried in
// one savepoint; when that fails, each event is tried in a savepoint of its
// own, so one event whose jobs cannot be inserted fails alone. It returns
// those events' errors by index.
func (p *outboxPoller) insertJobs(ctx context.Context, tx pgx.Tx, events []outboxEvent) (map[int]error, error) {
	if p.alsoInTx == nil {
		return nil, nil
	}
	inSavepoint := func(events []outboxEvent) error {
		sp, err := tx.Begin(ctx)
		if err != nil {
			return fmt.Errorf("opening a savepoint: %w", err)
		}
		if err := p.alsoInTx(ctx, sp, events); err != nil {
			sp.Rollback(ctx)
			return err
		}
		return sp.Commit(ctx)
	}
	err := inSavepoint(events)
	if err == nil {
		return nil, nil
	}
	if ctx.Err() != nil {
		return nil, err
	}
	failed := map[int]error{}
	if len(events) == 1 {
		failed[0] = err
		return failed, nil
	}
	for i := range events {
		if err := inSavepoint(events[i : i+1]); err != nil {
			if ctx.Err() != nil {
				return nil, err
			}
			failed[i] = fmt.Errorf("event %d: %w", events[i].ID, err)
		}
	}
	return failed, nil
}

// markFailed gives each failed event another attempt after an exponential
// backoff, or marks it dead after the maximum, with its own last_error.
func (p *outboxPoller) markFailed(ctx context.Context, q interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, ids []int64, attempts []int32, causes []string) error {
	delays := make([]float64, len(ids))
	for i, a := range attempts {
		delays[i] = backoffDelay(p.cfg.RetryBase, p.cfg.RetryMax, int(a)+1).Seconds()
	}
	_, err := q.Exec(ctx, `UPDATE outbox_events o SET attempts = o.attempts + 1, last_error = f.cause,
			next_attempt_at = now() + make_interval(secs => f.delay),
			dead_at = CASE WHEN o.attempts + 1 >= $4 THEN now() END
		FROM unnest($1::bigint[], $2::float8[], $3::text[]) AS f(id, delay, cause)
		WHERE o.id = f.id AND o.delivered_at IS NULL AND o.dead_at IS NULL`,
		ids, delays, causes, p.cfg.MaxAttempts)
	if err != nil {
		return fmt.Errorf("recording failed deliveries: %w", err)
	}
	return nil
}

// recordFailure gives every event of a batch whose transaction failed an
// attempt, in a transaction of its own, and returns cause.
func (p *outboxPoller) recordFailure(ctx context.Context, events []outboxEvent, attempts []int32, cause error) error {
	ids, causes := make([]int64, len(events)), make([]string, len(events))
	for i, e := range events {
		ids[i], causes[i] = e.ID, cause.Error()
	}
	failed := make(map[int]error, len(events))
	for i := range events {
		failed[i] = cause
	}
	if err := p.markFailed(ctx, p.db, ids, attempts, causes); err != nil {
		return errors.Join(cause, err)
	}
	p.countOutcomes(nil, failed, attempts, events, false) // deliverDue logs the cause once
	return cause
}

// countOutcomes counts a batch's delivered, retried and dead events and logs
// each dead one (and each retried one, when logRetries).
func (p *outboxPoller) countOutcomes(delivered []outboxEvent, failed map[int]error, attempts []int32, events []outboxEvent, logRetries bool) {
	p.metrics.delivered.Add(float64(len(delivered)))
	for _, e := range delivered {
		p.metrics.latency.Observe(time.Since(e.CreatedAt).Seconds())
	}
	for i, err := range failed {
		p.metrics.failed.Inc()
		log := p.log.WithFields(logrus.Fields{"event_id": events[i].ID, "attempt": attempts[i] + 1}).WithError(err)
		if uint(attempts[i])+1 >= p.cfg.MaxAttempts {
			p.metrics.dead.Inc()
			log.Error("event is dead: delivery given up after the maximum attempts")
		} else if logRetries {
			log.Warn("delivery failed; retrying after a backoff")
		}
	}
}

// runSequencer runs a sequencer step whenever this poller delivered (and on
// every poll), until ctx ends. A step numbers every delivered event it can
// see, so deliveries that commit while one runs share the next.
func (p *outboxPoller) runSequencer(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-p.sequence:
		}
		p.sequenceDelivered(ctx)
	}
}

// sequenceDelivered numbers the delivered events in steps of sequencerBatch
// and wakes the hubs with the newest. When another instance's step holds the
// delivery lock, it tries again shortly: that step may have taken its
// snapshot before this poller's delivery committed, so only a step that
// starts after it is sure to number it. It tries for one poll interval at
// most (a step takes milliseconds; a stop must not wait on a stuck lock
// holder), then leaves the events to the step of the next poll. A failed
// step is logged; its events are numbered by the next step, on this
// instance's next delivery or poll or another's.
func (p *outboxPoller) sequenceDelivered(ctx context.Context) {
	busy, giveUp := sequencerRetryBase, time.Now().Add(p.cfg.PollInterval)
	for {
		n, newest, locked, err := sequenceStep(ctx, p.db, sequencerBatch)
		if err != nil {
			if ctx.Err() == nil {
				p.metrics.sequenceFailed.Inc()
				p.log.WithError(err).Warn("numbering delivered events; the next step numbers them")
			}
			return
		}
		if !locked {
			if time.Now().After(giveUp) {
				p.log.WithField("waited", p.cfg.PollInterval.String()).Warn("the delivery lock stayed taken; the next poll's step numbers the delivered events")
				return
			}
			if sleepCtx(ctx, busy) != nil {
				return
			}
			busy = min(2*busy, sequencerRetryMax)
			continue
		}
		busy, giveUp = sequencerRetryBase, time.Now().Add(p.cfg.PollInterval)
		if n > 0 {
			p.wakeHubs(newest)
		}
		if n < sequencerBatch {
			return
		}
	}
}

// sequenceStep is the sequencer: it gives up to limit delivered, unnumbered
// events their delivery_seq, oldest id first, and returns how many and the
// newest, whole (the wake-up on Redis carries it). The step holds the
// delivery lock from its first number until its commit, so steps (and the
// deliveries of binaries from before partitioned delivery, which number
// under the same lock) commit in number order: a reader that sees number N
// sees every number below N that will ever exist.
// It only numbers committed deliveries; one that commits during the step
// waits for the next.
//
// Both statements are sent at once and run as one implicit transaction, one
// round trip, and the lock is held only while Postgres works. The first only
// tries the lock and notes in a transaction-local setting whether it got it;
// the second numbers only if it did, with a snapshot taken after the lock.
// A step that waited for the lock instead would hold its snapshot while it
// waits, and a queue of waiting steps holds back the cleanup of every
// delivered row (measured: four pollers delivered half of what two did).
// When the lock is taken, locked is false and nothing was numbered.
//
// Ids in one step are numbered in id order (WITH ORDINALITY, then nextval in
// that order): the events of one aggregate, delivered in id order by one
// partition's holder at a time, keep that order in the stream.
func sequenceStep(ctx context.Context, db *pgxpool.Pool, limit int) (n int, newest outboxEvent, locked bool, err error) {
	b := &pgx.Batch{}
	b.Queue(`SELECT set_config('outbox.sequencer_locked', pg_try_advisory_xact_lock($1)::text, true)::bool`, outboxDeliveryLock).
		QueryRow(func(row pgx.Row) error { return row.Scan(&locked) })
	b.Queue(`WITH numbered AS (
			UPDATE outbox_events o SET delivery_seq = n.seq
			FROM (SELECT id, nextval('outbox_delivery_seq') AS seq
				FROM unnest(ARRAY(SELECT id FROM outbox_events
						WHERE delivered_at IS NOT NULL AND delivery_seq IS NULL
							AND (SELECT current_setting('outbox.sequencer_locked')::bool)
						ORDER BY id LIMIT $1))
					WITH ORDINALITY AS t(id, n)
				ORDER BY n) n
			WHERE o.id = n.id
			RETURNING o.id, o.delivery_seq, o.event_type, o.aggregate_type, o.aggregate_id, o.payload, o.created_at)
		SELECT count(*) OVER (), id, delivery_seq, event_type, aggregate_type, aggregate_id, payload, created_at
		FROM numbered ORDER BY delivery_seq DESC LIMIT 1`, limit).QueryRow(func(row pgx.Row) error {
		err := row.Scan(&n, &newest.ID, &newest.Seq, &newest.Type, &newest.AggregateType, &newest.AggregateID, &newest.Payload, &newest.CreatedAt)
		if errors.Is(err, pgx.ErrNoRows) { // nothing to number
			return nil
		}
		return err
	})
	if err := db.SendBatch(ctx, b).Close(); err != nil {
		return 0, outboxEvent{}, false, fmt.Errorf("numbering delivered events: %w", err)
	}
	return n, newest, locked, nil
}

// wakeHubs hands the newest numbered event to the waker goroutine without
// waiting: if a wake-up is still queued it is replaced, since the hubs read
// everything up to the newest event from Postgres anyway.
func (p *outboxPoller) wakeHubs(newest outboxEvent) {
	select {
	case <-p.wakeQ:
	default:
	}
	// The sequencer goroutine, and after it the run goroutine's last step,
	// are the only senders, one after the other: this cannot block.
	p.wakeQ <- newest
}

// runWaker publishes the queued wake-ups on Redis until ctx ends. Each publish
// is bounded by wakeTimeout; a failure is counted and logged, never retried:
// every hub also catches up from Postgres on its poll tick.
func (p *outboxPoller) runWaker(ctx context.Context) {
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-p.wakeQ:
			msg, _ := json.Marshal(ev) // ints, strings, a time and valid JSON
			pctx, cancel := context.WithTimeout(ctx, wakeTimeout)
			err := p.rdb.Publish(pctx, eventsChannel, msg).Err()
			cancel()
			switch {
			case err != nil && ctx.Err() == nil:
				p.metrics.wakeFailed.Inc()
				if !failing { // once per outage, not once per batch
					p.log.WithError(err).Warn("cannot wake the SSE hubs over Redis; they catch up from Postgres on their poll")
				}
				failing = true
			case err == nil && failing:
				p.log.Info("waking the SSE hubs over Redis again")
				failing = false
			}
		}
	}
}

// outboxPendingCountMax bounds the count behind kumiko_outbox_pending: every
// poller counts once a beat, and counting a whole backlog costs what the
// backlog holds (~100 ms at 200,000, per instance, per beat), when the
// database is needed most. Past it the gauge reads this number: a backlog
// this large pages someone (KumikoOutboxBacklog) either way.
const outboxPendingCountMax = 10_000

// updatePending refreshes kumiko_outbox_pending, counting at most
// outboxPendingCountMax rows of the pending index.
func (p *outboxPoller) updatePending(ctx context.Context) error {
	var n int64
	if err := p.db.QueryRow(ctx, `SELECT count(*) FROM (SELECT FROM outbox_events
		WHERE delivered_at IS NULL AND dead_at IS NULL LIMIT $1) AS pending`, outboxPendingCountMax).Scan(&n); err != nil {
		return fmt.Errorf("counting pending outbox events: %w", err)
	}
	p.metrics.pending.Set(float64(n))
	return nil
}

// insertTriggeredJobs inserts the jobs the delivered events trigger, in the
// delivery's transaction: an event is marked delivered exactly when its jobs
// exist. Each subscription gets one job for its events of the batch; the job
// continues the trace of the first and links the others (deliverySpans).
func insertTriggeredJobs(j *jobs) func(ctx context.Context, tx pgx.Tx, events []outboxEvent) error {
	return func(ctx context.Context, tx pgx.Tx, events []outboxEvent) error {
		byType := map[string][]outboxEvent{}
		var types []string // in the order of their first event, for a stable insert order
		for _, ev := range events {
			if len(j.subscribers[ev.Type]) == 0 {
				continue
			}
			if byType[ev.Type] == nil {
				types = append(types, ev.Type)
			}
			byType[ev.Type] = append(byType[ev.Type], ev)
		}
		var params []river.InsertManyParams
		for _, typ := range types {
			evs := byType[typ]
			meta := deliverySpans(ctx, j.tracer, evs)
			for _, s := range j.subscribers[typ] {
				args, err := s.args(evs)
				if err != nil {
					return fmt.Errorf("%d %s events → job %s: %w", len(evs), typ, s.kind, err)
				}
				params = append(params, river.InsertManyParams{Args: args, InsertOpts: &river.InsertOpts{Metadata: meta}})
			}
		}
		if len(params) == 0 {
			return nil
		}
		if _, err := j.client.InsertManyTx(ctx, tx, params); err != nil {
			return fmt.Errorf("inserting %d jobs: %w", len(params), err)
		}
		return nil
	}
}

// deliverySpans marks each event's delivery inside its writer's trace and
// returns the metadata that carries them into the job the events trigger.
func deliverySpans(ctx context.Context, tracer trace.Tracer, evs []outboxEvent) []byte {
	var t jobTrace
	for i, ev := range evs {
		ctx, span := tracer.Start(withTraceparent(ctx, ev.Traceparent), "outbox.deliver "+ev.Type,
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attribute.Int64("outbox.event_id", ev.ID)))
		switch {
		case i == 0:
			t.Traceparent = traceparentOf(ctx)
		case len(t.Links) < jobTraceLinks:
			t.Links = append(t.Links, traceparentOf(ctx))
		}
		span.End()
	}
	meta, _ := json.Marshal(t)
	return meta
}

// outboxMetrics is what the outbox adds to /metrics.
type outboxMetrics struct {
	pending        prometheus.Gauge
	delivered      prometheus.Counter
	failed         prometheus.Counter
	dead           prometheus.Counter
	wakeFailed     prometheus.Counter
	sequenceFailed prometheus.Counter
	latency        prometheus.Histogram
}

func newOutboxMetrics(r prometheus.Registerer) *outboxMetrics {
	f := promauto.With(r)
	return &outboxMetrics{
		pending: f.NewGauge(prometheus.GaugeOpts{
			Namespace: metricNamespace, Name: "outbox_pending",
			Help: fmt.Sprintf("Outbox events neither delivered nor dead, counted up to %d (a larger backlog reads %[1]d).", outboxPendingCountMax),
		}),
		delivered: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "outbox_delivered_total", Help: "Outbox events delivered by this instance.",
		}),
		failed: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "outbox_failed_total", Help: "Outbox delivery attempts that failed (retried later).",
		}),
		dead: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "outbox_dead_total", Help: "Outbox events given up after the maximum attempts.",
		}),
		wakeFailed: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "outbox_wake_failed_total", Help: "Redis wake-ups of the SSE hubs that failed (delivery is unaffected; hubs poll Postgres).",
		}),
		sequenceFailed: f.NewCounter(prometheus.CounterOpts{
			Namespace: metricNamespace, Name: "outbox_sequencer_failed_total", Help: "Sequencer steps that failed (their events are numbered by a later step).",
		}),
		latency: f.NewHistogram(prometheus.HistogramOpts{
			Namespace: metricNamespace, Name: "outbox_delivery_latency_seconds", Help: "From writing an event to its delivery.",
			Buckets: []float64{.001, .0025, .005, .01, .02, .05, .1, .25, .5, 1, 5, 30},
		}),
	}
}
