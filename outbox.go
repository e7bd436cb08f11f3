package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgxlisten"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

const (
	// outboxNotifyChannel is the Postgres channel the insert trigger notifies.
	outboxNotifyChannel = "outbox_events"
	// outboxDeliveryLock is the advisory lock a delivery transaction holds
	// from taking its sequence numbers until it commits (see migration 2).
	outboxDeliveryLock = advisoryLockKey
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
// business row and its event commit, or roll back, together.
func writeOutboxEvent(ctx context.Context, tx pgx.Tx, aggregateType, aggregateID, eventType string, payload any) (int64, error) {
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

// outboxPoller delivers outbox events: it claims due rows with FOR UPDATE
// SKIP LOCKED, inserts the jobs they trigger and marks them delivered in one
// transaction, then wakes the SSE hubs over Redis. An insert wakes it
// (LISTEN/NOTIFY); a slow poll is the fallback. Failed deliveries back off
// exponentially and die after a maximum. Rows a crashed poller held are
// picked again by the next poller: their transaction died with its connection.
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
	metrics *metrics
	// alsoInTx inserts the jobs the events trigger, in the delivery
	// transaction (in a savepoint: an error fails only those events).
	alsoInTx func(ctx context.Context, tx pgx.Tx, events []outboxEvent) error

	wake  chan struct{}    // buffered 1: "there may be new rows"
	wakeQ chan outboxEvent // buffered 1: the newest delivered event, for runWaker
}

// outboxPollerDeps is what newOutboxPoller builds a poller from.
type outboxPollerDeps struct {
	db         *pgxpool.Pool
	redis      *redis.Client
	cfg        outboxConfig
	beat       *heartbeat
	beatEvery  time.Duration
	insertJobs func(ctx context.Context, tx pgx.Tx, events []outboxEvent) error // in the delivery transaction
	log        *logrus.Logger
	metrics    *metrics
	onPanic    func(component string, recovered any)
}

func newOutboxPoller(d outboxPollerDeps) *outboxPoller {
	return &outboxPoller{startStop: newStartStop("outboxPoller", stopSoft, d.onPanic),
		db: d.db, rdb: d.redis, cfg: d.cfg, beat: d.beat, beatInt: d.beatEvery, alsoInTx: d.insertJobs,
		log: d.log.WithField("component", "outboxPoller"), metrics: d.metrics,
		wake: make(chan struct{}, 1), wakeQ: make(chan outboxEvent, 1)}
}

// Start checks the outbox synchronously (the table is there, the heartbeat
// can be written), then starts the poller goroutine. It returns once started.
func (p *outboxPoller) Start(ctx context.Context) error {
	return p.start(ctx, func(ctx context.Context) error {
		if err := p.updatePending(ctx); err != nil {
			return err
		}
		return p.beat.beat(ctx)
	}, p.run)
}

func (p *outboxPoller) run(ctx context.Context) {
	// The listener only wakes the loop; if it is down (or off) the poll still delivers.
	if p.cfg.Listen {
		defer p.goOwned(ctx, p.listen).stop()
	}
	// The waker publishes after the commits, so Redis never holds a delivery.
	defer p.goOwned(ctx, p.runWaker).stop()

	stopping := p.stopping()
	poll := time.NewTicker(p.cfg.PollInterval)
	defer poll.Stop()
	beat := time.NewTicker(p.beatInt)
	defer beat.Stop()
	for {
		p.deliverDue(ctx)
		select {
		case <-stopping:
			return
		case <-p.wake:
		case <-poll.C:
			if err := p.updatePending(ctx); err != nil && ctx.Err() == nil {
				p.log.WithError(err).Warn("counting pending events")
			}
		case <-beat.C:
			if err := p.beat.beat(ctx); err != nil && ctx.Err() == nil {
				p.log.WithError(err).Warn("heartbeat")
			}
		}
	}
}

// listen turns NOTIFY outbox_events into wake-ups, reconnecting after an
// outage (and waking the loop then, to catch up on what it missed).
func (p *outboxPoller) listen(ctx context.Context) {
	wake := func() {
		select {
		case p.wake <- struct{}{}:
		default:
		}
	}
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
	l.Handle(outboxNotifyChannel, wakeHandler(wake))
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
// asked to stop, or a batch fails.
func (p *outboxPoller) deliverDue(ctx context.Context) {
	for {
		select {
		case <-p.stopping():
			return
		default:
		}
		n, err := p.deliverBatch(ctx)
		if err != nil {
			if ctx.Err() == nil {
				p.log.WithError(err).Warn("delivery failed")
			}
			return
		}
		if n < int(p.cfg.BatchSize) {
			return
		}
	}
}

// deliverBatch claims up to BatchSize due events and delivers them in one
// transaction: the jobs each event triggers are inserted, the event is marked
// delivered with its delivery_seq, and both commit together. An event whose
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

	// One delivery at a time across all instances: the sequence numbers it
	// takes must become visible in their order (see migration 2). Another
	// instance delivering now will find these rows too.
	var locked bool
	if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock($1)`, outboxDeliveryLock).Scan(&locked); err != nil {
		return 0, fmt.Errorf("taking the delivery lock: %w", err)
	}
	if !locked {
		return 0, nil
	}
	events, attempts, err := claimDue(ctx, tx, p.cfg.BatchSize)
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
		p.wakeHubs(delivered[len(delivered)-1])
	}
	return len(events), nil
}

// claimDue locks up to limit due events, oldest first, with their attempts so far.
func claimDue(ctx context.Context, tx pgx.Tx, limit uint) ([]outboxEvent, []int32, error) {
	rows, err := tx.Query(ctx, `SELECT id, event_type, aggregate_type, aggregate_id, payload, created_at, attempts, coalesce(traceparent, '')
		FROM outbox_events
		WHERE delivered_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
		ORDER BY id LIMIT $1
		FOR UPDATE SKIP LOCKED`, limit)
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
// whose jobs exist delivered (with their delivery_seq) and gives the others an
// attempt. It returns the delivered events, in order, and the failed ones by
// index. An error means the transaction itself is unusable.
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
		// Sequence numbers are taken last, for the events that are delivered:
		// a number is never given to an event that stays pending. One nextval
		// per event, so they are unique whoever else draws from the sequence.
		rows, err := tx.Query(ctx, `SELECT nextval('outbox_delivery_seq') FROM generate_series(1, $1::int)`, len(delivered))
		if err != nil {
			return nil, nil, fmt.Errorf("taking delivery sequence numbers: %w", err)
		}
		seqs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return nil, nil, fmt.Errorf("taking delivery sequence numbers: %w", err)
		}
		slices.Sort(seqs)
		ids := make([]int64, len(delivered))
		for i := range delivered {
			delivered[i].Seq = seqs[i]
			ids[i] = delivered[i].ID
		}
		if _, err := tx.Exec(ctx, `UPDATE outbox_events o SET delivered_at = now(), delivery_seq = d.seq, last_error = NULL
			FROM unnest($1::bigint[], $2::bigint[]) AS d(id, seq) WHERE o.id = d.id`, ids, seqs); err != nil {
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
	p.metrics.outboxDelivered.Add(float64(len(delivered)))
	for _, e := range delivered {
		p.metrics.outboxLatency.Observe(time.Since(e.CreatedAt).Seconds())
	}
	for i, err := range failed {
		p.metrics.outboxFailed.Inc()
		log := p.log.WithFields(logrus.Fields{"event_id": events[i].ID, "attempt": attempts[i] + 1}).WithError(err)
		if uint(attempts[i])+1 >= p.cfg.MaxAttempts {
			p.metrics.outboxDead.Inc()
			log.Error("event is dead: delivery given up after the maximum attempts")
		} else if logRetries {
			log.Warn("delivery failed; retrying after a backoff")
		}
	}
}

// wakeHubs hands the newest delivered event to the waker goroutine without
// waiting: if a wake-up is still queued it is replaced, since the hubs read
// everything up to the newest event from Postgres anyway.
func (p *outboxPoller) wakeHubs(newest outboxEvent) {
	select {
	case <-p.wakeQ:
	default:
	}
	p.wakeQ <- newest // the run goroutine is the only sender: this cannot block
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
				p.metrics.outboxWakeFailed.Inc()
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

// updatePending refreshes kumiko_outbox_pending.
func (p *outboxPoller) updatePending(ctx context.Context) error {
	var n int64
	if err := p.db.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE delivered_at IS NULL AND dead_at IS NULL`).Scan(&n); err != nil {
		return fmt.Errorf("counting pending outbox events: %w", err)
	}
	p.metrics.outboxPending.Set(float64(n))
	return nil
}
