package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// hubPage bounds one read of delivered events by the hub.
const hubPage = 500

// streamPage bounds one replay read by a stream handler: what a reader that
// stopped reading can hold, however far back its Last-Event-ID points.
const streamPage = 100

// sendChunk and sendBuffer make the write timeout a progress floor: a stream
// is dropped when fewer than about sendChunk bytes reach its client within
// KUMIKO_SSE_WRITE_TIMEOUT (1.6 KB/s at the default 10 s), not when one write
// waited that long. Two things made a single write wait far longer than its
// bytes need at a steady slow reader: a write of everything pending at once
// (up to streamBuffer frames, about 1 MB), and the kernel, which wakes a
// writer blocked on a full send buffer only when a third of it is free again
// — of a buffer autotuned up to tcp_wmem's 4 MB, that was 1.3 MB, so every
// reader below ~130 KB/s was cut after the timeout. So writes go out in
// chunks of sendChunk, each with its own deadline, and a stream's socket
// keeps a fixed send buffer of sendBuffer (the kernel doubles it; a blocked
// write wakes once about 5 KB of it drained). The price: a stream moves at
// most about 16 KB per round trip (320 KB/s at 50 ms), plenty for events.
const (
	sendChunk  = 16 << 10
	sendBuffer = 8 << 10
)

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
	metrics *metrics

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

// sseStream is one client's stream as the hub sees it.
type sseStream struct {
	ip      string
	next    int64         // the next feed frame this stream reads (only its handler touches it)
	closed  chan struct{} // closed by the hub: the drain
	retry   time.Duration // the goodbye's retry hint, set by the drain before it closes closed
	ctx     context.Context
	cancel  context.CancelFunc
	rc      *http.ResponseController
	timeout time.Duration

	mu     sync.Mutex
	forced bool // the drain gave up on this stream: no more writes
}

// errStreamForced ends a stream the drain force-closed.
var errStreamForced = errors.New("event stream force-closed by the drain")

// arm gives the next write its deadline. The stream's lock orders it against
// forceClose, so a handler cannot push back a deadline the drain pulled in.
func (s *sseStream) arm() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.forced {
		return errStreamForced
	}
	if err := s.rc.SetWriteDeadline(time.Now().Add(s.timeout)); err != nil {
		return fmt.Errorf("setting the write deadline: %w", err)
	}
	return nil
}

// forceClose makes a write in progress fail now and every later one at once,
// and cancels what the handler waits for: it returns without a hijack.
func (s *sseStream) forceClose() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.forced = true
	_ = s.rc.SetWriteDeadline(time.Now()) // fails only when the connection is gone already
	s.cancel()
}

// write hands frames to net/http's buffer, which may write to the client:
// within the write timeout.
func (s *sseStream) write(w http.ResponseWriter, frames []byte) error {
	if err := s.arm(); err != nil {
		return err
	}
	if _, err := w.Write(frames); err != nil {
		return fmt.Errorf("writing to the event stream: %w", err)
	}
	return nil
}

// flush sends what is buffered to the client within the write timeout.
func (s *sseStream) flush() error {
	if err := s.arm(); err != nil {
		return err
	}
	if err := s.rc.Flush(); err != nil {
		return fmt.Errorf("flushing the event stream: %w", err)
	}
	return nil
}

// sendFrames writes the feed frames after *cursor and flushes them, a
// deadline per sendChunk bytes; *cursor moves to the last one. The frames are
// gathered into chunks of sendChunk: net/http's buffers are 2 and 4 KB, and
// frames written one by one would leave in a system call per 4 KB, a call
// that costs the same for 300 bytes or 16 KB. The oldest frame's age is the
// stream's send lag.
func (h *sseHub) sendFrames(s *sseStream, w http.ResponseWriter, frames []feedFrame, cursor *int64) error {
	buf, _ := h.sendBuffers.Get().(*[]byte)
	if buf == nil {
		buf = new([]byte)
	}
	defer h.sendBuffers.Put(buf)
	out := (*buf)[:0]
	var oldest time.Time
	for _, f := range frames {
		if f.seq <= *cursor {
			continue // already sent by the replay
		}
		if len(out) == 0 {
			oldest = f.written
		}
		out = append(out, f.frame...)
		*cursor = f.seq
	}
	*buf = out
	if len(out) == 0 {
		return nil
	}
	for len(out) > 0 {
		n := min(len(out), sendChunk)
		if err := s.arm(); err != nil { // a deadline per chunk: judged by progress
			return err
		}
		if _, err := w.Write(out[:n]); err != nil {
			return fmt.Errorf("writing to the event stream: %w", err)
		}
		out = out[n:]
	}
	if err := s.flush(); err != nil {
		return err
	}
	h.metrics.sseSendLag.Observe(time.Since(oldest).Seconds())
	return nil
}

// limitSendBuffer gives a stream's socket a fixed send buffer of sendBuffer,
// so a blocked write wakes after a few KB reached the client instead of a
// third of a buffer the kernel may have grown to megabytes (see sendChunk).
func limitSendBuffer(ctx context.Context) {
	if tc, ok := ctx.Value(connKey{}).(*net.TCPConn); ok {
		_ = tc.SetWriteBuffer(sendBuffer) // best effort: the chunked writes still bound each wait
	}
}

// send writes frames and flushes them.
func (s *sseStream) send(w http.ResponseWriter, frames []byte) error {
	if err := s.write(w, frames); err != nil {
		return err
	}
	return s.flush()
}

func newSSEHub(db *pgxpool.Pool, rdb *redis.Client, cfg sseConfig, poll time.Duration, log *logrus.Logger, m *metrics, onPanic func(string, any)) *sseHub {
	return &sseHub{startStop: newStartStop("sse", stopNow, onPanic),
		db: db, rdb: rdb, cfg: cfg, poll: poll, log: log.WithField("component", "sse"), metrics: m,
		handlers: map[*sseStream]struct{}{}, subscribed: map[*sseStream]struct{}{}, perIP: map[string]uint{},
		replaying: make(chan struct{}, max(1, db.Config().MaxConns/4)), wake: make(chan struct{})}
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
		case n == hubPage:
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

// wakePerStream is the spacing of wakes per open stream. A stream writes at
// most once per wake, so the spacing bounds the fan-out's writes to 200,000
// a second however fast events come: events in between ride in the same
// write. 10,000 streams are woken at most every 50 ms, 100 every 0.5 ms. A
// write measured 10-20 µs of CPU at 10,000 streams on 2 cores, most of it
// in write(2): past a few thousand streams, the writes a wake asks for
// take longer than the gap, and streams write as often as they get through.
const (
	wakePerStream = 5 * time.Microsecond
	maxWakeGap    = 100 * time.Millisecond
)

// wakeStreams wakes the waiting streams now, or schedules a wake when the
// last one was too recent. feedMu is held.
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

// open registers a stream for a client at ip, writing through rc; it returns
// the hub's position at that moment. The stream counts against
// KUMIKO_SSE_MAX_STREAMS and KUMIKO_SSE_MAX_STREAMS_PER_IP until release.
func (h *sseHub) open(ctx context.Context, ip string, rc *http.ResponseController) (*sseStream, int64, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closing {
		return nil, 0, apiError(http.StatusServiceUnavailable, "unavailable", "instance is draining")
	}
	if uint(len(h.handlers)) >= h.cfg.MaxStreams {
		return nil, 0, apiError(http.StatusServiceUnavailable, "too_many_streams", "this instance serves its maximum of event streams; retry")
	}
	if h.cfg.MaxStreamsPerIP > 0 && h.perIP[ip] >= h.cfg.MaxStreamsPerIP {
		return nil, 0, apiError(http.StatusTooManyRequests, "too_many_streams_from_ip",
			fmt.Sprintf("at most %d event streams per client address; close one first", h.cfg.MaxStreamsPerIP))
	}
	s := &sseStream{ip: ip, closed: make(chan struct{}), rc: rc, timeout: h.cfg.WriteTimeout}
	s.ctx, s.cancel = context.WithCancel(ctx)
	h.handlers[s] = struct{}{}
	h.subscribed[s] = struct{}{}
	h.perIP[ip]++
	h.active.Add(1)
	h.metrics.sseStreams.Inc()
	h.streamsNow.Add(1)
	// The stream reads the feed from here on: every event after cursor.
	h.feedMu.RLock()
	defer h.feedMu.RUnlock()
	s.next = h.written
	return s, h.cursor, nil
}

// release is the last thing a stream handler does: only now is its slot free.
func (h *sseHub) release(s *sseStream) {
	s.cancel()
	h.mu.Lock()
	if _, ok := h.subscribed[s]; ok {
		delete(h.subscribed, s)
		close(s.closed)
	}
	delete(h.handlers, s)
	if h.perIP[s.ip]--; h.perIP[s.ip] == 0 {
		delete(h.perIP, s.ip)
	}
	h.metrics.sseStreams.Dec()
	h.streamsNow.Add(-1)
	h.mu.Unlock()
	h.active.Done()
}

// openStreams is the number of stream handlers that have not returned, the
// value of kumiko_sse_streams (both change under h.mu).
func (h *sseHub) openStreams() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.handlers)
}

// closeStreams is drain step 4: every stream is asked to end with `event:
// shutdown` and a retry hint, and no new one opens. http.Server.Shutdown never
// ends a streaming response by itself, so without this the drain would always
// wait for its timeout. The goodbyes are spread (spreadGoodbyes) over a window
// of step per stream, at most spread and at most what is left of the drain
// budget, so the instances the clients move to are not hit by all of them in
// the same instant. The handlers get until drain ends (the drain budget) to
// say goodbye; a reader that stopped reading cannot take the goodbye, so what
// is left then is force-closed and waited for until hard ends.
func (h *sseHub) closeStreams(drain, hard context.Context, spread, step time.Duration) (streamsClosed, error) {
	start := time.Now()
	h.mu.Lock()
	h.closing = true
	r := streamsClosed{asked: len(h.handlers)}
	streams := make([]*sseStream, 0, len(h.subscribed))
	for s := range h.subscribed {
		streams = append(streams, s)
	}
	h.mu.Unlock()

	left := spread
	if deadline, ok := drain.Deadline(); ok {
		left = time.Until(deadline)
	}
	r.window = spreadWindow(len(streams), spread, step, left)
	// Who goes first is random, not the map's order, nor the order the streams opened in.
	rand.Shuffle(len(streams), func(i, j int) { streams[i], streams[j] = streams[j], streams[i] })
	plan := spreadGoodbyes(len(streams), h.cfg.RetryHint, r.window)
	for i := 0; i < len(plan); {
		if wait := plan[i].at - time.Since(start); wait > 0 && sleepCtx(drain, wait) != nil {
			break // the budget is spent: the rest are force-closed below
		}
		h.mu.Lock()
		for elapsed := time.Since(start); i < len(plan) && plan[i].at <= elapsed; i++ {
			// A goodbye that goes out late (a busy CPU, a timer that fired
			// late) gets a shorter hint, so its client still comes back at
			// the moment it was aimed at, not in a bunch with the others.
			late := elapsed - plan[i].at
			h.sayGoodbye(streams[i], max(h.cfg.RetryHint, plan[i].retry-late))
		}
		h.mu.Unlock()
	}

	ended := make(chan struct{})
	go func() { h.active.Wait(); close(ended) }()
	select {
	case <-ended:
		return r, nil
	case <-drain.Done():
	}

	h.mu.Lock()
	r.forced = len(h.handlers)
	for s := range h.handlers {
		s.forceClose()
	}
	h.mu.Unlock()
	select {
	case <-ended:
		return r, nil
	case <-hard.Done():
		return r, fmt.Errorf("event stream handlers still running after being force-closed: %w", context.Cause(hard))
	}
}

// streamsClosed is what closeStreams did.
type streamsClosed struct {
	asked  int           // streams open when the step began
	forced int           // of those, force-closed at the end of the drain budget
	window time.Duration // their reconnects were spread over this; the goodbyes over its first half
}

// sayGoodbye ends s's stream with the retry hint retry. h.mu is held.
func (h *sseHub) sayGoodbye(s *sseStream, retry time.Duration) {
	if _, ok := h.subscribed[s]; !ok {
		return // its client left, or it fell behind, while it waited for its turn
	}
	s.retry = retry // before the close: the handler reads it once closed is
	delete(h.subscribed, s)
	close(s.closed)
}

// spreadWindow is the window the reconnects of n streams are spread over:
// step per stream, at most spread and at most left (of the drain budget). It
// grows with the streams because a few clients coming back at once are no
// storm, and a window they do not need would only keep them waiting.
func spreadWindow(n int, spread, step, left time.Duration) time.Duration {
	w := spread
	if step > 0 && time.Duration(n) < spread/step { // n*step < spread, without overflowing
		w = time.Duration(n) * step
	}
	return max(0, min(w, left))
}

// goodbye is when the drain closes one stream, after the step began, and the
// retry hint it gives that stream's client.
type goodbye struct {
	at, retry time.Duration
}

// spreadGoodbyes plans the goodbyes of n streams so that their clients come
// back evenly over window, after the base retry hint (KUMIKO_SSE_RETRY). The
// k-th client is aimed at a random moment of the k-th of n equal slots of the
// window; half of the way there is spent before its goodbye, half in its
// retry hint. Clients that honour the hint arrive evenly over the whole
// window; clients that ignore it (reconnect at once) still arrive spread over
// its first half, and the streams are closed in that half, well inside the
// drain budget. A window of 0 is the old way: every goodbye at once with the
// base hint. The plan is in the order of its goodbyes.
func spreadGoodbyes(n int, base, window time.Duration) []goodbye {
	plan := make([]goodbye, n)
	for k := range plan {
		aim := time.Duration((float64(k) + rand.Float64()) / float64(n) * float64(window))
		plan[k] = goodbye{at: aim / 2, retry: base + aim - aim/2}
	}
	return plan
}

// handleEvents is GET /api/events: delivered events as Server-Sent Events,
// `id:` being the outbox id. A client that reconnects with Last-Event-ID (or
// ?lastEventId=) gets every event delivered after that one, then the live
// stream, in delivery order — also when it moves to another instance. When
// that event is no longer kept (outbox retention deleted it), the stream
// starts with `event: reset` instead: the client reloads its state and goes on
// from the id the reset frame carries.
//
// Every write has a deadline (KUMIKO_SSE_WRITE_TIMEOUT): a client that stops
// reading ends its stream instead of pinning the handler, its memory and its
// slot. Nothing is read from Postgres while a write is pending, and a replay
// reads one page of streamPage events at a time.
//
// Before the stream starts, the lookup of Last-Event-ID is bounded by budget
// (the request's dependency budget): a hung database is a 503, not a
// connection that hangs.
func handleEvents(h *sseHub, db *pgxpool.Pool, cfg sseConfig, instanceID string, budget time.Duration) echo.HandlerFunc {
	return func(c echo.Context) error {
		lastID, resuming, err := lastEventID(c.Request())
		if err != nil {
			return err
		}
		limitSendBuffer(c.Request().Context())
		// The controller must reach net/http's writer: echo.Response is an
		// http.Flusher that swallows flush errors.
		rc := http.NewResponseController(c.Response().Unwrap())
		s, cursor, err := h.open(c.Request().Context(), c.RealIP(), rc)
		if err != nil {
			c.Response().Header().Set("Retry-After", strconv.Itoa(max(1, int(cfg.RetryHint.Round(time.Second).Seconds()))))
			return err
		}
		defer h.release(s)
		ctx := s.ctx
		var reset []byte
		if resuming {
			rctx, cancel := context.WithTimeout(ctx, budget)
			r, err := resumePoint(rctx, db, lastID)
			cancel()
			if err != nil {
				return err
			}
			cursor = r.seq
			if r.expired {
				reset = resetFrame(r)
			}
		}

		w := c.Response()
		w.Header().Set(echo.HeaderContentType, "text/event-stream")
		w.Header().Set(echo.HeaderCacheControl, "no-cache")
		w.Header().Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
		// The write deadlines stay on the connection: it must not serve another request.
		w.Header().Set(echo.HeaderConnection, "close")
		w.WriteHeader(http.StatusOK)
		err = s.send(w, fmt.Appendf(reset, "retry: %d\n\n", cfg.RetryHint.Milliseconds()))

		// Replay from Postgres what the client has not seen, a page at a
		// time; feed frames that arrive meanwhile are skipped below if
		// already sent. A new client (no Last-Event-ID) starts at the feed's
		// position and needs no replay.
		for err == nil && resuming {
			var events []outboxEvent
			if events, err = h.replayPage(ctx, cursor); err != nil {
				break
			}
			var frame []byte
			for i := 0; i < len(events) && err == nil; i++ {
				frame = appendEvent(frame[:0], &events[i])
				err = s.write(w, frame)
				cursor = events[i].Seq
			}
			if err == nil && len(events) > 0 {
				err = s.flush()
			}
			if len(events) < streamPage {
				break
			}
		}

		heartbeat := time.NewTicker(cfg.Heartbeat)
		defer heartbeat.Stop()
		var batch []feedFrame
		for err == nil {
			select {
			case <-s.closed:
			case <-ctx.Done():
			default:
				// Everything new in the feed goes out in one write and one
				// flush: a stream that fell behind catches up in one go.
				frames, wake, behind := h.pending(s, batch[:0])
				if behind {
					// Too far behind: end it rather than hold frames for it;
					// the client resumes from its Last-Event-ID. The stream
					// counts against the caps until this handler has returned.
					h.metrics.sseDropped.Inc()
					return nil
				}
				batch = frames
				if len(frames) > 0 {
					err = h.sendFrames(s, w, frames, &cursor)
					clear(batch) // let the feed's frames go once the ring moves on
					if err != nil {
						continue
					}
				}
				// Even after a write, the stream waits for the next wake: it
				// writes at most once per wake, also when it is behind, so
				// the wake spacing bounds the fan-out's writes.
				select {
				case <-wake:
					continue
				case <-heartbeat.C:
					err = s.send(w, []byte(": ping\n\n"))
					continue
				case <-s.closed:
				case <-ctx.Done():
				}
			}
			select {
			case <-s.closed:
				if err = s.send(w, fmt.Appendf(nil, "event: shutdown\ndata: {\"instanceId\":%q}\nretry: %d\n\n", instanceID, s.retry.Milliseconds())); err == nil {
					return nil
				}
			default: // ctx ended: the client left, or the drain force-closed the stream
				return nil
			}
		}
		h.streamEnded(err)
		return nil // the response is committed: the stream just ends
	}
}

// replayPage reads the next page of a stream's replay, waiting for a replay slot.
func (h *sseHub) replayPage(ctx context.Context, cursor int64) ([]outboxEvent, error) {
	select {
	case h.replaying <- struct{}{}:
	case <-ctx.Done():
		return nil, context.Cause(ctx)
	}
	defer func() { <-h.replaying }()
	return deliveredAfter(ctx, h.db, cursor, streamPage)
}

// streamEnded logs why a stream ended early. A client that left is routine; a
// client that stopped reading, or a stream the drain had to force-close, is
// worth a line.
func (h *sseHub) streamEnded(err error) {
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		h.log.WithFields(logrus.Fields{"event": "stream_dropped", "reason": "write_timeout",
			"write_timeout_ms": h.cfg.WriteTimeout.Milliseconds()}).Info("event stream dropped: the client stopped reading")
	case errors.Is(err, errStreamForced):
		h.log.WithFields(logrus.Fields{"event": "stream_dropped", "reason": "forced"}).Info("event stream force-closed by the drain")
	default:
		h.log.WithFields(logrus.Fields{"event": "stream_dropped", "reason": "client_gone"}).WithError(err).Debug("event stream ended")
	}
}

// resume is where a reconnecting client's stream starts.
type resume struct {
	seq       int64 // the delivery position to replay after
	expired   bool  // the client's last event is no longer kept: it must reload its state
	requested int64 // the client's Last-Event-ID
	oldest    int64 // the oldest event id still kept (0: none)
	from      int64 // after a reset: the newest delivered event, where the stream goes on from (0: none)
}

// lastEventID is where the client asks its stream to resume: the
// Last-Event-ID header, else ?lastEventId= (an EventSource cannot set the
// header on its first connection). 0 means "from the beginning": everything
// the outbox still keeps. resuming is false when neither was given.
func lastEventID(r *http.Request) (id int64, resuming bool, err error) {
	v, ok := r.Header["Last-Event-Id"] // canonical form of Last-Event-ID
	if !ok {
		query, err := url.ParseQuery(r.URL.RawQuery)
		if err != nil {
			return 0, false, apiError(http.StatusBadRequest, "invalid_query", "the query string is not valid URL encoding")
		}
		if v, ok = query["lastEventId"]; !ok {
			return 0, false, nil
		}
	}
	switch {
	case len(v) != 1:
		return 0, false, apiError(http.StatusBadRequest, "invalid_last_event_id", "Last-Event-ID: give it once")
	case v[0] == "": // what an EventSource that has seen no id would mean
		return 0, false, nil
	}
	id, err = parseLastEventID(v[0])
	return id, err == nil, err
}

// parseLastEventID reads an event id: decimal digits only (no sign, no
// spaces, no "0x"), at most an int64; 0 asks for every event still kept.
func parseLastEventID(s string) (int64, error) {
	invalid := apiError(http.StatusBadRequest, "invalid_last_event_id",
		"Last-Event-ID: must be an event id (digits), or 0 to replay from the beginning")
	if s == "" || strings.IndexFunc(s, func(r rune) bool { return r < '0' || r > '9' }) >= 0 {
		return 0, invalid
	}
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, invalid
	}
	return id, nil
}

// resumePoint finds where in the delivery order the client's last event was.
// An id that is gone although later ones exist was deleted by the outbox
// retention (or never committed): what the client missed cannot be replayed,
// so the stream resets to the newest delivered event. Id 0 is before every
// event: the replay starts at the oldest one kept.
func resumePoint(ctx context.Context, db *pgxpool.Pool, id int64) (resume, error) {
	r := resume{requested: id}
	if id == 0 {
		return r, nil
	}
	var seq *int64
	var found bool
	var maxID int64
	err := db.QueryRow(ctx, `SELECT
			EXISTS (SELECT 1 FROM outbox_events WHERE id = $1),
			(SELECT delivery_seq FROM outbox_events WHERE id = $1),
			coalesce((SELECT min(id) FROM outbox_events), 0),
			coalesce((SELECT max(id) FROM outbox_events), 0)`, id).Scan(&found, &seq, &r.oldest, &maxID)
	if err != nil {
		return resume{}, fmt.Errorf("looking up Last-Event-ID %d: %w", id, err)
	}
	switch {
	case found && seq != nil:
		r.seq = *seq
		return r, nil
	case found || id > maxID:
		return resume{}, apiError(http.StatusBadRequest, "unknown_last_event_id", fmt.Sprintf("event %d was never delivered", id))
	}
	r.expired = true
	err = db.QueryRow(ctx, `SELECT coalesce(max(delivery_seq), 0),
			coalesce((SELECT id FROM outbox_events WHERE delivery_seq IS NOT NULL ORDER BY delivery_seq DESC LIMIT 1), 0)
		FROM outbox_events`).Scan(&r.seq, &r.from)
	if err != nil {
		return resume{}, fmt.Errorf("reading the newest delivered event: %w", err)
	}
	return r, nil
}

// resetFrame tells a client that its Last-Event-ID is older than what the
// outbox keeps. Its id moves the client's Last-Event-ID to the newest event,
// so a later reconnect resumes from there instead of resetting again.
func resetFrame(r resume) []byte {
	data, _ := json.Marshal(map[string]any{ // ints and a string
		"reason":       "last_event_id_expired",
		"message":      "events after your Last-Event-ID are no longer kept: reload your state, then go on from resumeFrom",
		"lastEventId":  r.requested,
		"oldestKeptId": r.oldest,
		"resumeFrom":   r.from,
	})
	var b []byte
	if r.from != 0 {
		b = fmt.Appendf(b, "id: %d\n", r.from)
	}
	return fmt.Appendf(b, "event: reset\ndata: %s\n\n", data)
}

// publicEvent is what a stream client sees of a delivered event: the outbox
// id it resumes from and dedupes by, and the payload. The aggregate's
// internal id and the delivery position stay inside: sequential numbers would
// tell anyone the business's volume.
type publicEvent struct {
	ID            int64           `json:"id"`
	Type          string          `json:"type"`
	AggregateType string          `json:"aggregateType"`
	Payload       json.RawMessage `json:"payload"`
	CreatedAt     time.Time       `json:"createdAt"`
}

func appendEvent(b []byte, ev *outboxEvent) []byte {
	// Fields are ints, strings, a time and valid JSON: Marshal cannot fail.
	data, _ := json.Marshal(publicEvent{ID: ev.ID, Type: ev.Type, AggregateType: ev.AggregateType, Payload: ev.Payload, CreatedAt: ev.CreatedAt})
	return fmt.Appendf(b, "id: %d\nevent: %s\ndata: %s\n\n", ev.ID, ev.Type, data)
}
