package main

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// componentSSEHub is the event stream hub.
var componentSSEHub = component{name: "sseHub"}

// sseConfig is the event stream's settings.
type sseConfig struct {
	MaxStreams      uint
	Heartbeat       time.Duration
	RetryHint       time.Duration
	WriteTimeout    time.Duration
	MaxStreamsPerIP uint
	// The drain spreads the streams' reconnects over a window of
	// ReconnectSpreadPerStream per open stream, at most ReconnectSpread.
	ReconnectSpread          time.Duration
	ReconnectSpreadPerStream time.Duration
}

func (c *sseConfig) settings() []configSetting {
	return []configSetting{
		{key: "sse.maxStreams", env: "KUMIKO_SSE_MAX_STREAMS", def: "5000", value: uintValue{p: &c.MaxStreams, min: 1},
			doc: "open event streams per instance; beyond, 503 (5,000 measured safe on 2 cores)"},
		{key: "sse.heartbeat", env: "KUMIKO_SSE_HEARTBEAT", def: "15s", value: durationValue{p: &c.Heartbeat},
			doc: "comment lines that keep idle proxies from closing a stream", old: "sse.heartbeatSec"},
		{key: "sse.retry", env: "KUMIKO_SSE_RETRY", def: "1s", value: durationValue{p: &c.RetryHint},
			doc: "the retry: hint a client waits before reconnecting", old: "sse.retrySec"},
		{key: "sse.reconnectSpread", env: "KUMIKO_SSE_RECONNECT_SPREAD", def: "10s", value: durationValue{p: &c.ReconnectSpread, zeroOK: true},
			doc: "the drain spreads its streams' reconnects over up to this (and at most the drain budget): each goodbye's retry: hint differs, the streams close over the first half; 0: all at once"},
		{key: "sse.reconnectSpreadPerStream", env: "KUMIKO_SSE_RECONNECT_SPREAD_PER_STREAM", def: "2ms", value: durationValue{p: &c.ReconnectSpreadPerStream},
			doc: "the spread grows by this per open stream (5,000 streams: 10s, 500 per second on the instances they move to; 1 stream: no wait)"},
		{key: "sse.writeTimeout", env: "KUMIKO_SSE_WRITE_TIMEOUT", def: "10s", value: durationValue{p: &c.WriteTimeout},
			doc: "a stream that moves less than 16 KB to its client within this is dropped: a stalled reader cannot pin a handler, a slow steady one is not cut", old: "sse.writeTimeoutSec"},
		{key: "sse.maxStreamsPerIp", env: "KUMIKO_SSE_MAX_STREAMS_PER_IP", def: "20", value: uintValue{p: &c.MaxStreamsPerIP},
			doc: "open streams per client address; beyond, 429; 0 turns the cap off"},
	}
}

func (c *sseConfig) validate(http httpConfig) []error {
	return rule(http.MaxConns == 0 || http.MaxConns > c.MaxStreams,
		"http.maxConns (%d) must exceed sse.maxStreams (%d), or the event streams alone can take every API connection",
		http.MaxConns, c.MaxStreams)
}

// The event stream (GET /api/events) in five files, one job each:
//   - sse_feed.go, here: the hub reads delivered events from Postgres into
//     one feed of encoded frames and wakes the streams, paced.
//   - sse_registry.go: opening and releasing a stream, under the caps.
//   - sse_stream.go: one stream's write path, with its deadlines.
//   - sse_handler.go: the handler: resume, replay, then live until the end.
//   - sse_drain.go: the drain's goodbyes, spread over a window.

// hubPage bounds one read of delivered events by the hub.
const hubPage = 500

// streamBuffer is how far (in events) a stream may fall behind the hub before
// it is closed; its client reconnects with Last-Event-ID and loses nothing. It
// is the length of the hub's feed, the one copy of the recent encoded frames
// every stream reads from.
const streamBuffer = 1024

// sseHub fans delivered events out to this instance's event streams.
// Postgres is the source of truth: the hub reads delivered events in delivery
// order (delivery_seq), so no stream ever skips one. Redis pub/sub only wakes
// it — from any instance's poller — and a periodic catch-up covers messages a
// Redis outage swallowed.
//
// Its Stop (from startStop, stopNow) ends the hub goroutine and a catch-up in
// progress at once. Streams are closed by closeStreams, a step of the drain,
// before it runs.
type sseHub struct {
	*startStop
	db      *pgxpool.Pool
	rdb     *redis.Client
	cfg     sseConfig
	poll    time.Duration
	log     *logrus.Entry
	metrics *sseMetrics

	mu sync.Mutex
	// handlers are the streams whose handler has not returned yet: they count
	// against the caps, and the drain force-closes them. subscribed is the
	// subset the hub still hands events to.
	handlers   map[*sseStream]struct{}
	subscribed map[*sseStream]struct{}
	perIP      map[string]uint
	closing    bool // the drain has begun: no new streams
	active     sync.WaitGroup

	// The feed is how events reach the streams: the hub appends each event's
	// frame, encoded once, to a ring of streamBuffer frames and wakes every
	// waiting stream by closing wake; each stream copies what is new to it
	// and writes it. Publishing costs the same for 10 streams or 10,000, no
	// lock is held while writing to a client, and a slow stream delays only
	// itself. feedMu is not h.mu: opening and closing streams do not contend
	// with the readers of the feed.
	feedMu  sync.RWMutex
	feed    [streamBuffer]feedFrame
	written int64         // frames ever appended to the feed; frame n is feed[n%streamBuffer]
	wake    chan struct{} // closed and replaced when streams are woken (see wakeStreams)
	cursor  int64         // delivery_seq of the last event in the feed
	// Waking every stream costs a write and a flush per stream: wakes are
	// spaced by wakeInterval, so the fan-out's CPU stays bounded however
	// many streams are open; events in between go out in the same write.
	lastWake   time.Time
	wakeTimer  *time.Timer // a wake scheduled for later, or nil
	streamsNow atomic.Int64

	// replaying bounds the replay reads in flight, so a crowd of streams
	// reconnecting at once (another instance drained) queues here instead of
	// taking every pool connection the API and the workers need.
	replaying chan struct{}

	// sendBuffers lend a stream the buffer it gathers one write in; they are
	// as many as the writes in progress, not as the streams.
	sendBuffers sync.Pool

	pubsub *redis.PubSub
}

// feedFrame is one delivered event in the hub's feed, as every stream sends it.
type feedFrame struct {
	seq     int64
	written time.Time // when the event was written (its outbox row's created_at)
	frame   []byte    // shared by every stream: never modified after publishing
}

// sseHubDeps is what newSSEHub builds the hub from.
type sseHubDeps struct {
	db      *pgxpool.Pool
	redis   *redis.Client
	cfg     sseConfig
	poll    time.Duration // the catch-up from Postgres, for wake-ups Redis lost
	log     *logrus.Logger
	metrics *sseMetrics
	onPanic func(c component, recovered any)
}

func newSSEHub(d sseHubDeps) *sseHub {
	return &sseHub{startStop: newStartStop(componentSSEHub, stopNow, d.onPanic),
		db: d.db, rdb: d.redis, cfg: d.cfg, poll: d.poll, log: componentSSEHub.log(d.log), metrics: d.metrics,
		handlers: map[*sseStream]struct{}{}, subscribed: map[*sseStream]struct{}{}, perIP: map[string]uint{},
		replaying: make(chan struct{}, max(1, d.db.Config().MaxConns/4)), wake: make(chan struct{})}
}

// Start subscribes to the events channel and reads where delivery stands, both
// synchronously, then starts the hub goroutine.
func (h *sseHub) Start(ctx context.Context) error {
	return h.start(ctx, func(ctx context.Context) error {
		if err := h.db.QueryRow(ctx, `SELECT coalesce(max(delivery_seq), 0) FROM outbox_events`).Scan(&h.cursor); err != nil {
			return fmt.Errorf("reading the delivery position: %w", err)
		}
		pubsub := h.rdb.Subscribe(ctx, eventsChannel)
		if _, err := pubsub.Receive(ctx); err != nil {
			pubsub.Close()
			return fmt.Errorf("subscribing to %s: %w", eventsChannel, err)
		}
		h.pubsub = pubsub
		return nil
	}, h.run)
}

func (h *sseHub) run(ctx context.Context) {
	defer func() {
		if err := h.pubsub.Close(); err != nil {
			h.log.WithError(err).Warn("closing the events subscription")
		}
	}()
	messages := h.pubsub.Channel()
	tick := time.NewTicker(h.poll)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
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
// delivery order, until it reaches target: the newest event a poller
// announced. Pollers announce only after their transaction committed, so the
// event is readable by then; the brief retries are a guard, and what a read
// still misses, the next tick finds.
func (h *sseHub) catchUp(ctx context.Context, target int64) {
	if h.skipWhileIdle(ctx, target) {
		return
	}
	wait := catchUpRetryFirst
	for {
		n, err := h.readAfterCursor(ctx)
		if err != nil {
			if ctx.Err() == nil {
				h.log.WithError(err).Warn("reading delivered events")
			}
			return
		}
		switch {
		case n == hubPage:
			continue
		case h.position() >= target || wait > catchUpRetryLast:
			return
		}
		if sleepCtx(ctx, wait) != nil {
			return
		}
		wait *= 2
	}
}

// skipWhileIdle moves the cursor to target without reading an event while no
// stream is open: nobody would read them, and the pollers of a busy cluster
// deliver thousands a second. A stream opened next starts there (open reads
// the cursor under feedMu, after counting itself in streamsNow) and replays
// what came before from Postgres. A tick (target 0) asks where delivery
// stands: one index lookup, not a page of events. It says whether it skipped.
func (h *sseHub) skipWhileIdle(ctx context.Context, target int64) bool {
	if h.streamsNow.Load() > 0 {
		return false
	}
	if target == 0 {
		if err := h.db.QueryRow(ctx, `SELECT coalesce(max(delivery_seq), 0) FROM outbox_events`).Scan(&target); err != nil {
			if ctx.Err() == nil {
				h.log.WithError(err).Warn("reading the delivery position")
			}
			return true
		}
	}
	h.feedMu.Lock()
	defer h.feedMu.Unlock()
	if h.streamsNow.Load() > 0 {
		return false // a stream opened meanwhile: it reads from the cursor as it is
	}
	h.cursor = max(h.cursor, target)
	return true
}

func (h *sseHub) position() int64 {
	h.feedMu.RLock()
	defer h.feedMu.RUnlock()
	return h.cursor
}

// readAfterCursor reads the next page of delivered events and appends them
// to the feed, each encoded once for every stream.
func (h *sseHub) readAfterCursor(ctx context.Context) (int, error) {
	events, err := deliveredAfter(ctx, h.db, h.position(), hubPage)
	if err != nil {
		return 0, err
	}
	frames := make([]feedFrame, 0, len(events))
	for i := range events {
		frames = append(frames, feedFrame{seq: events[i].Seq, written: events[i].CreatedAt, frame: appendEvent(nil, &events[i])})
	}
	h.publish(frames)
	return len(events), nil
}

// publish appends frames (in delivery order) to the feed and wakes the
// streams. Only the hub goroutine publishes.
func (h *sseHub) publish(frames []feedFrame) {
	h.feedMu.Lock()
	defer h.feedMu.Unlock()
	appended := false
	for _, f := range frames {
		if f.seq <= h.cursor {
			continue
		}
		h.feed[h.written%streamBuffer] = f
		h.written++
		h.cursor = f.seq
		appended = true
	}
	if appended {
		h.wakeStreams()
	}
}

// wakeStreams wakes the waiting streams now, or schedules a wake when the
// last one was too recent (wakePerStream per open stream, at most
// maxWakeGap: timeouts.go). feedMu is held.
func (h *sseHub) wakeStreams() {
	gap := min(maxWakeGap, time.Duration(h.streamsNow.Load())*wakePerStream)
	if since := time.Since(h.lastWake); since < gap {
		if h.wakeTimer == nil {
			// One short-lived timer goroutine at a time; it only closes a channel.
			h.wakeTimer = time.AfterFunc(gap-since, func() {
				h.feedMu.Lock()
				defer h.feedMu.Unlock()
				h.wakeTimer = nil
				h.wakeNow()
			})
		}
		return
	}
	h.wakeNow()
}

func (h *sseHub) wakeNow() {
	close(h.wake)
	h.wake = make(chan struct{})
	h.lastWake = time.Now()
}

// pending appends to buf the frames of the feed s has not read yet and
// advances s past them; wake is closed by the next append. behind says s
// fell more than streamBuffer frames behind: those frames are gone.
func (h *sseHub) pending(s *sseStream, buf []feedFrame) (frames []feedFrame, wake <-chan struct{}, behind bool) {
	h.feedMu.RLock()
	defer h.feedMu.RUnlock()
	if h.written-s.next > streamBuffer {
		return buf, nil, true
	}
	for ; s.next < h.written; s.next++ {
		buf = append(buf, h.feed[s.next%streamBuffer])
	}
	return buf, h.wake, false
}

// deliveredAfter reads up to limit delivered events after seq, in delivery order.
func deliveredAfter(ctx context.Context, db *pgxpool.Pool, seq int64, limit int) ([]outboxEvent, error) {
	rows, err := db.Query(ctx, `SELECT id, delivery_seq, event_type, aggregate_type, aggregate_id, payload, created_at
		FROM outbox_events WHERE delivery_seq > $1 ORDER BY delivery_seq LIMIT $2`, seq, limit)
	if err != nil {
		return nil, fmt.Errorf("reading delivered events after %d: %w", seq, err)
	}
	events, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (outboxEvent, error) {
		var e outboxEvent
		err := row.Scan(&e.ID, &e.Seq, &e.Type, &e.AggregateType, &e.AggregateID, &e.Payload, &e.CreatedAt)
		return e, err
	})
	if err != nil {
		return nil, fmt.Errorf("reading delivered events after %d: %w", seq, err)
	}
	return events, nil
}
