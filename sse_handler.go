package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/sirupsen/logrus"
)

// GET /api/events: the events feature and its handler, from Last-Event-ID to
// the goodbye. See sse_feed.go for the whole stream.

// streamPage bounds one replay read by a stream handler: what a reader that
// stopped reading can hold, however far back its Last-Event-ID points.
const streamPage = 100

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
		if c.Request().Method == http.MethodHead {
			// The headers a GET would get, and no stream: net/http would
			// swallow its writes, and the stream would hold a slot for nothing.
			setStreamHeaders(c.Response().Header())
			return c.NoContent(http.StatusOK)
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
		setStreamHeaders(w.Header())
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
					h.metrics.dropped.Inc()
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

// setStreamHeaders sets the headers of an event stream's answer.
func setStreamHeaders(h http.Header) {
	h.Set(echo.HeaderContentType, "text/event-stream")
	h.Set(echo.HeaderCacheControl, "no-cache")
	h.Set("X-Accel-Buffering", "no") // nginx: do not buffer the stream
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

// eventsFeature is GET /api/events: every delivered outbox event, streamed
// (sse_feed.go), resumable with Last-Event-ID on any instance.
func eventsFeature() feature {
	return feature{name: "events", uses: []dependency{usesDB, usesStreams}, routes: []route{
		{method: http.MethodGet, path: "/api/events", streaming: true, handler: func(d routeDeps) echo.HandlerFunc {
			return handleEvents(d.sse, d.db, d.cfg.SSE, d.cfg.InstanceID, d.timeouts.request)
		}},
	}}
}
