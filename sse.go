package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// replayPage bounds one read of delivered events from Postgres.
const replayPage = 500

// streamBuffer is how far a stream may fall behind the hub before it is
// closed; its client reconnects with Last-Event-ID and loses nothing.
const streamBuffer = 1024

// sseHub fans delivered events out to this instance's event streams.
// Postgres is the source of truth: the hub reads delivered events in delivery
// order (delivery_seq), so no stream ever skips one. Redis pub/sub only wakes
// it — from any instance's poller — and a periodic catch-up covers messages a
// Redis outage swallowed.
type sseHub struct {
	db      *pgxpool.Pool
	rdb     *redis.Client
	cfg     sseConfig
	poll    time.Duration
	log     *logrus.Entry
	metrics *metrics
	onPanic func(recovered any)

	mu      sync.Mutex
	streams map[*sseStream]struct{}
	cursor  int64 // delivery_seq of the last event handed to the streams
	closing bool  // the drain has begun: no new streams
	active  sync.WaitGroup

	pubsub   *redis.PubSub
	stopping chan struct{}
	done     chan struct{}
}

// sseStream is one client's stream as the hub sees it.
type sseStream struct {
	events   chan outboxEvent
	closed   chan struct{} // closed by the hub: the drain, or a client too slow
	shutdown bool          // closed by the drain: say goodbye with a retry hint
}

func newSSEHub(db *pgxpool.Pool, rdb *redis.Client, cfg sseConfig, poll time.Duration, log *logrus.Logger, m *metrics, onPanic func(any)) *sseHub {
	return &sseHub{db: db, rdb: rdb, cfg: cfg, poll: poll, log: log.WithField("component", "sse"), metrics: m,
		onPanic: onPanic, streams: map[*sseStream]struct{}{}}
}

// Start subscribes to the events channel and reads where delivery stands, both
// synchronously, then starts the hub goroutine.
func (h *sseHub) Start(ctx context.Context) error {
	if h.done != nil {
		return errors.New("sse hub already started")
	}
	if err := h.db.QueryRow(ctx, `SELECT coalesce(max(delivery_seq), 0) FROM outbox_events`).Scan(&h.cursor); err != nil {
		return fmt.Errorf("reading the delivery position: %w", err)
	}
	pubsub := h.rdb.Subscribe(ctx, eventsChannel)
	if _, err := pubsub.Receive(ctx); err != nil {
		pubsub.Close()
		return fmt.Errorf("subscribing to %s: %w", eventsChannel, err)
	}
	h.pubsub, h.stopping, h.done = pubsub, make(chan struct{}), make(chan struct{})
	go h.run(context.WithoutCancel(ctx))
	return nil
}

// Stop ends the hub goroutine and waits for it. Streams are closed by
// closeStreams, a step of the drain, before this runs.
func (h *sseHub) Stop(ctx context.Context) error {
	if h.done == nil {
		return nil
	}
	h.mu.Lock()
	select {
	case <-h.stopping:
	default:
		close(h.stopping)
	}
	h.mu.Unlock()
	select {
	case <-h.done:
		return h.pubsub.Close()
	case <-ctx.Done():
		return fmt.Errorf("sse hub did not stop: %w", context.Cause(ctx))
	}
}

func (h *sseHub) run(ctx context.Context) {
	defer close(h.done)
	defer func() {
		if r := recover(); r != nil {
			h.onPanic(r)
		}
	}()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { // let a catch-up in progress end with the hub
		select {
		case <-h.stopping:
		case <-ctx.Done():
		}
		cancel()
	}()

	messages := h.pubsub.Channel()
	tick := time.NewTicker(h.poll)
	defer tick.Stop()
	for {
		select {
		case <-h.stopping:
			return
		case msg := <-messages:
			var ev outboxEvent
			if err := json.Unmarshal([]byte(msg.Payload), &ev); err != nil {
				h.log.WithError(err).Warn("undecodable event message")
				continue
			}
			h.catchUp(ctx, ev.Seq)
		case <-tick.C:
			h.catchUp(ctx, 0)
		}
	}
}

// catchUp hands every delivered event after the cursor to the streams, in
// delivery order, until it reaches target. A poller publishes just before it
// commits, so an event may be announced a moment before it can be read: the
// hub then retries briefly; what it still cannot see, the next tick finds (or
// it was never committed: its numbers were burned, and nothing is lost).
func (h *sseHub) catchUp(ctx context.Context, target int64) {
	wait := time.Millisecond
	for {
		n, err := h.readAfterCursor(ctx)
		if err != nil {
			if ctx.Err() == nil {
				h.log.WithError(err).Warn("reading delivered events")
			}
			return
		}
		switch {
		case n == replayPage:
			continue
		case h.position() >= target || wait > 128*time.Millisecond:
			return
		}
		if sleepCtx(ctx, wait) != nil {
			return
		}
		wait *= 2
	}
}

func (h *sseHub) position() int64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.cursor
}

func (h *sseHub) readAfterCursor(ctx context.Context) (int, error) {
	events, err := deliveredAfter(ctx, h.db, h.position())
	if err != nil {
		return 0, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, ev := range events {
		if ev.Seq <= h.cursor {
			continue
		}
		h.cursor = ev.Seq
		for s := range h.streams {
			select {
			case s.events <- ev:
			default:
				// Too far behind: close it rather than block everyone; the
				// client resumes from its Last-Event-ID.
				delete(h.streams, s)
				close(s.closed)
				h.metrics.sseDropped.Inc()
			}
		}
	}
	return len(events), nil
}

// deliveredAfter reads up to replayPage delivered events after seq, in delivery order.
func deliveredAfter(ctx context.Context, db *pgxpool.Pool, seq int64) ([]outboxEvent, error) {
	rows, err := db.Query(ctx, `SELECT id, delivery_seq, event_type, aggregate_type, aggregate_id, payload, created_at
		FROM outbox_events WHERE delivery_seq > $1 ORDER BY delivery_seq LIMIT $2`, seq, replayPage)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (outboxEvent, error) {
		var e outboxEvent
		err := row.Scan(&e.ID, &e.Seq, &e.Type, &e.AggregateType, &e.AggregateID, &e.Payload, &e.CreatedAt)
		return e, err
	})
}

// open registers a stream; it returns the hub's position at that moment.
func (h *sseHub) open() (*sseStream, int64, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closing {
		return nil, 0, apiError(http.StatusServiceUnavailable, "unavailable", "instance is draining")
	}
	if uint(len(h.streams)) >= h.cfg.MaxStreams {
		return nil, 0, apiError(http.StatusServiceUnavailable, "too_many_streams", "this instance serves its maximum of event streams; retry")
	}
	s := &sseStream{events: make(chan outboxEvent, streamBuffer), closed: make(chan struct{})}
	h.streams[s] = struct{}{}
	h.active.Add(1)
	h.metrics.sseStreams.Inc()
	return s, h.cursor, nil
}

func (h *sseHub) release(s *sseStream) {
	h.mu.Lock()
	if _, ok := h.streams[s]; ok {
		delete(h.streams, s)
		close(s.closed)
	}
	h.mu.Unlock()
	h.metrics.sseStreams.Dec()
	h.active.Done()
}

// closeStreams is drain step 4: every stream ends with `event: shutdown` and a
// retry hint, and no new one opens. http.Server.Shutdown never ends a
// streaming response by itself, so without this the drain would always wait
// for its timeout. It returns when every stream handler has returned.
func (h *sseHub) closeStreams(ctx context.Context) (int, error) {
	h.mu.Lock()
	h.closing = true
	n := len(h.streams)
	for s := range h.streams {
		s.shutdown = true
		delete(h.streams, s)
		close(s.closed)
	}
	h.mu.Unlock()
	ended := make(chan struct{})
	go func() { h.active.Wait(); close(ended) }()
	select {
	case <-ended:
		return n, nil
	case <-ctx.Done():
		return n, fmt.Errorf("event streams still open: %w", context.Cause(ctx))
	}
}

// handleEvents is GET /api/events: delivered events as Server-Sent Events,
// `id:` being the outbox id. A client that reconnects with Last-Event-ID (or
// ?lastEventId=) gets every event delivered after that one, then the live
// stream, in delivery order — also when it moves to another instance.
func handleEvents(h *sseHub, db *pgxpool.Pool, cfg sseConfig, instanceID string) echo.HandlerFunc {
	return func(c echo.Context) error {
		ctx := c.Request().Context()
		lastID := c.Request().Header.Get("Last-Event-ID")
		if lastID == "" {
			lastID = c.QueryParam("lastEventId")
		}
		s, cursor, err := h.open()
		if err != nil {
			c.Response().Header().Set("Retry-After", "1")
			return err
		}
		defer h.release(s)
		if lastID != "" {
			if cursor, err = resumeSeq(ctx, db, lastID); err != nil {
				return err
			}
		}

		w := c.Response()
		w.Header().Set(echo.HeaderContentType, "text/event-stream")
		w.Header().Set(echo.HeaderCacheControl, "no-cache")
		w.Header().Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
		w.WriteHeader(http.StatusOK)
		fmt.Fprintf(w, "retry: %d\n\n", cfg.RetryHint.Milliseconds())
		w.Flush()

		// Replay from Postgres what the client has not seen; live events the
		// hub hands over meanwhile are skipped below if already sent.
		for {
			events, err := deliveredAfter(ctx, db, cursor)
			if err != nil {
				return nil // the client reconnects and resumes
			}
			for _, ev := range events {
				writeEvent(w, ev)
				cursor = ev.Seq
			}
			w.Flush()
			if len(events) < replayPage {
				break
			}
		}

		heartbeat := time.NewTicker(cfg.Heartbeat)
		defer heartbeat.Stop()
		for {
			select {
			case ev := <-s.events:
				if ev.Seq <= cursor {
					continue
				}
				writeEvent(w, ev)
				cursor = ev.Seq
				w.Flush()
			case <-heartbeat.C:
				fmt.Fprint(w, ": ping\n\n")
				w.Flush()
			case <-s.closed:
				if s.shutdown {
					fmt.Fprintf(w, "event: shutdown\ndata: {\"instanceId\":%q}\nretry: %d\n\n", instanceID, cfg.RetryHint.Milliseconds())
					w.Flush()
				}
				return nil
			case <-ctx.Done():
				return nil
			}
		}
	}
}

// resumeSeq finds where in the delivery order the client's last event was.
func resumeSeq(ctx context.Context, db *pgxpool.Pool, lastID string) (int64, error) {
	id, err := strconv.ParseInt(lastID, 10, 64)
	if err != nil || id < 1 {
		return 0, apiError(http.StatusBadRequest, "invalid_last_event_id", "Last-Event-ID must be an event id")
	}
	var seq *int64
	err = db.QueryRow(ctx, `SELECT delivery_seq FROM outbox_events WHERE id = $1`, id).Scan(&seq)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && seq == nil) {
		return 0, apiError(http.StatusBadRequest, "unknown_last_event_id", fmt.Sprintf("event %d was never delivered", id))
	}
	if err != nil {
		return 0, err
	}
	return *seq, nil
}

func writeEvent(w *echo.Response, ev outboxEvent) {
	data, _ := json.Marshal(ev) // fields are ints, strings, a time and valid JSON
	fmt.Fprintf(w, "id: %d\nevent: %s\ndata: %s\n\n", ev.ID, ev.Type, data)
}
