package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgxlisten"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

const (
	// eventsChannel is the Redis pub/sub channel every delivered event is
	// published on; every instance's SSE hub subscribes to it.
	eventsChannel = "kumiko:events"
	// outboxNotifyChannel is the Postgres channel the insert trigger notifies.
	outboxNotifyChannel = "outbox_events"
	// outboxDeliveryLock is the advisory lock a delivery transaction holds
	// from taking its sequence numbers until it commits (see migration 2).
	outboxDeliveryLock = 0x6b756d696b6f // "kumiko"
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
// SKIP LOCKED, inserts the jobs they trigger, publishes them on Redis and
// marks them delivered in one transaction. An insert wakes it (LISTEN/NOTIFY); a slow poll is the
// fallback. Failed deliveries back off exponentially and die after a maximum.
// Rows a crashed poller held are picked again by the next poller: their
// transaction died with its connection.
type outboxPoller struct {
	db      *pgxpool.Pool
	rdb     *redis.Client
	cfg     outboxConfig
	beat    *heartbeat
	beatInt time.Duration
	log     *logrus.Entry
	metrics *metrics
	onPanic func(recovered any)
	// alsoInTx runs in every delivery transaction (the jobs the events
	// trigger are inserted there), before the batch is published.
	alsoInTx func(ctx context.Context, tx pgx.Tx, events []outboxEvent) error

	wake chan struct{} // buffered 1: "there may be new rows"

	mu       sync.Mutex
	stopping chan struct{}      // closed by Stop: finish the batch, pick no new one
	hardStop context.CancelFunc // cancels a batch in flight (its transaction rolls back)
	done     chan struct{}      // closed when the poller goroutine has returned
}

func newOutboxPoller(db *pgxpool.Pool, rdb *redis.Client, cfg outboxConfig, beat *heartbeat, beatInterval time.Duration,
	alsoInTx func(context.Context, pgx.Tx, []outboxEvent) error, log *logrus.Logger, m *metrics, onPanic func(recovered any)) *outboxPoller {
	return &outboxPoller{db: db, rdb: rdb, cfg: cfg, beat: beat, beatInt: beatInterval, alsoInTx: alsoInTx,
		log: log.WithField("component", "outboxPoller"), metrics: m, onPanic: onPanic, wake: make(chan struct{}, 1)}
}

// Start checks the outbox synchronously (the table is there, the heartbeat
// can be written), then starts the poller goroutine. It returns once started.
func (p *outboxPoller) Start(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done != nil {
		return errors.New("outbox poller already started")
	}
	if err := p.updatePending(ctx); err != nil {
		return err
	}
	if err := p.beat.beat(ctx); err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	p.stopping, p.hardStop, p.done = make(chan struct{}), cancel, make(chan struct{})
	go p.run(runCtx)
	return nil
}

// Stop asks the poller to finish the batch in hand and pick no new one, and
// waits for it. When ctx ends first the batch is cancelled: its transaction
// rolls back and the rows stay pending for the next poller. Stop returns by
// ctx's end (plus a moment's grace) even if a call it cancelled is stuck on a
// socket; that call then ends on its own timeout. Stop without Start, and a
// second Stop, return at once.
func (p *outboxPoller) Stop(ctx context.Context) error {
	p.mu.Lock()
	if p.done == nil {
		p.mu.Unlock()
		return nil
	}
	select {
	case <-p.stopping:
	default:
		close(p.stopping)
	}
	done, hardStop := p.done, p.hardStop
	p.mu.Unlock()

	select {
	case <-done:
		hardStop()
		return nil
	case <-ctx.Done():
		hardStop()
		select {
		case <-done:
		case <-time.After(abandonGrace):
		}
		return fmt.Errorf("outbox poller stopped hard: %w", context.Cause(ctx))
	}
}

func (p *outboxPoller) run(ctx context.Context) {
	defer close(p.done)
	defer p.recoverPanic()

	// The listener only wakes the loop; if it is down (or off) the poll still delivers.
	if p.cfg.Listen {
		listenCtx, stopListening := context.WithCancel(ctx)
		listening := make(chan struct{})
		go func() {
			defer close(listening)
			defer p.recoverPanic()
			p.listen(listenCtx)
		}()
		defer func() { stopListening(); <-listening }()
	}

	poll := time.NewTicker(p.cfg.PollInterval)
	defer poll.Stop()
	beat := time.NewTicker(p.beatInt)
	defer beat.Stop()
	for {
		p.deliverDue(ctx)
		select {
		case <-p.stopping:
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

// recoverPanic is deferred by the poller's goroutines: a panic there turns
// into a graceful shutdown instead of killing the process mid-batch.
func (p *outboxPoller) recoverPanic() {
	if r := recover(); r != nil {
		p.onPanic(r)
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
		case <-p.stopping:
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
// transaction. It returns how many it claimed.
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
	rows, err := tx.Query(ctx, `SELECT id, event_type, aggregate_type, aggregate_id, payload, created_at, attempts, coalesce(traceparent, '')
		FROM outbox_events
		WHERE delivered_at IS NULL AND dead_at IS NULL AND next_attempt_at <= now()
		ORDER BY id LIMIT $1
		FOR UPDATE SKIP LOCKED`, p.cfg.BatchSize)
	if err != nil {
		return 0, fmt.Errorf("claiming events: %w", err)
	}
	var events []outboxEvent
	var attempts []int32
	for rows.Next() {
		var e outboxEvent
		var a int32
		if err := rows.Scan(&e.ID, &e.Type, &e.AggregateType, &e.AggregateID, &e.Payload, &e.CreatedAt, &a, &e.Traceparent); err != nil {
			rows.Close()
			return 0, fmt.Errorf("reading claimed events: %w", err)
		}
		events, attempts = append(events, e), append(attempts, a)
	}
	if err := rows.Err(); err != nil {
		return 0, fmt.Errorf("claiming events: %w", err)
	}
	if len(events) == 0 {
		return 0, tx.Commit(ctx)
	}

	var last int64
	if err := tx.QueryRow(ctx, `SELECT setval('outbox_delivery_seq', nextval('outbox_delivery_seq') + $1 - 1)`, len(events)).Scan(&last); err != nil {
		return 0, fmt.Errorf("taking delivery sequence numbers: %w", err)
	}
	ids, seqs := make([]int64, len(events)), make([]int64, len(events))
	for i := range events {
		events[i].Seq = last - int64(len(events)-1-i)
		ids[i], seqs[i] = events[i].ID, events[i].Seq
	}

	if p.alsoInTx != nil {
		if err := p.alsoInTx(ctx, tx, events); err != nil {
			return 0, err
		}
	}
	if err := p.publish(ctx, events); err != nil {
		return len(events), p.recordFailure(ctx, tx, ids, attempts, err)
	}
	if _, err := tx.Exec(ctx, `UPDATE outbox_events o SET delivered_at = now(), delivery_seq = d.seq, last_error = NULL
		FROM unnest($1::bigint[], $2::bigint[]) AS d(id, seq) WHERE o.id = d.id`, ids, seqs); err != nil {
		return 0, fmt.Errorf("marking events delivered: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("committing the delivery: %w", err)
	}
	p.metrics.outboxDelivered.Add(float64(len(events)))
	for _, e := range events {
		p.metrics.outboxLatency.Observe(time.Since(e.CreatedAt).Seconds())
	}
	return len(events), nil
}

// publish sends the batch on Redis in one round trip, in delivery order.
func (p *outboxPoller) publish(ctx context.Context, events []outboxEvent) error {
	pipe := p.rdb.Pipeline()
	for _, e := range events {
		msg, err := json.Marshal(e)
		if err != nil {
			return fmt.Errorf("encoding event %d: %w", e.ID, err)
		}
		pipe.Publish(ctx, eventsChannel, msg)
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return fmt.Errorf("publishing %d events: %w", len(events), err)
	}
	return nil
}

// recordFailure gives every event of a failed batch another attempt after an
// exponential backoff, or marks it dead after the maximum, and commits that.
func (p *outboxPoller) recordFailure(ctx context.Context, tx pgx.Tx, ids []int64, attempts []int32, cause error) error {
	delays := make([]float64, len(ids))
	dead := 0
	for i, a := range attempts {
		delays[i] = backoffDelay(p.cfg.RetryBase, p.cfg.RetryMax, int(a)+1).Seconds()
		if uint(a)+1 >= p.cfg.MaxAttempts {
			dead++
		}
	}
	_, err := tx.Exec(ctx, `UPDATE outbox_events o SET attempts = o.attempts + 1, last_error = $3,
			next_attempt_at = now() + make_interval(secs => f.delay),
			dead_at = CASE WHEN o.attempts + 1 >= $4 THEN now() END
		FROM unnest($1::bigint[], $2::float8[]) AS f(id, delay) WHERE o.id = f.id`,
		ids, delays, cause.Error(), p.cfg.MaxAttempts)
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		return errors.Join(cause, fmt.Errorf("recording the failed delivery: %w", err))
	}
	p.metrics.outboxFailed.Add(float64(len(ids)))
	p.metrics.outboxDead.Add(float64(dead))
	return cause
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
