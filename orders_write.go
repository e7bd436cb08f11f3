package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// maxOrderBatch bounds the orders one statement writes (its arrays, its
// time in PostgreSQL); a full batch is followed by a new one.
const maxOrderBatch = 64

// errNoTimeToCommit is an order whose request had too little of its budget
// left to join a statement (orderWriter.margin): it is not written, and the
// request is answered 503 with Retry-After like any missed deadline.
var errNoTimeToCommit = fmt.Errorf("too little of the request's budget left to write the order: %w", context.DeadlineExceeded)

// errOrderConflict is an order the statement did not insert because a unique
// index already holds its public id or its Idempotency-Key: what a unique
// violation says on a statement of its own, and handled the same way.
var errOrderConflict = errors.New("the order's public id or Idempotency-Key is taken")

// orderWriter writes orders, each with its order.created outbox event, in
// one statement per group of requests: group commit, done by the service.
// Under load most of an order's cost in PostgreSQL is per statement and per
// commit, not per row — the commit's WAL flush, the outbox trigger's NOTIFY
// (which every notifying commit takes a cluster-wide lock for), the wake-up
// of each delivering instance it causes and the round trip — so requests
// that arrive together share one.
//
// Nothing waits for company: a request that finds a statement slot free
// writes its order at once, alone, so an idle service answers as fast as
// before. Only while maxInFlight statements are running do requests gather
// in the next batch; when a slot frees, one of them runs it. Every order is
// still atomic with its event (one statement), and each request gets its own
// answer: its row, errOrderConflict, or the statement's error, which
// retrySafe treats as before; a row the database refuses fails alone (the
// batch's rows are then written one by one). No goroutine of its own: each
// statement runs on the goroutine of a request of its batch, which the drain
// counts as in flight like any other.
//
// An order is written if and only if its request is answered with it. So
// a request decides once, under the lock, whether its order goes into a
// statement: only with at least margin of its budget left, and never after
// it has left. Until a statement takes its order, a request whose budget
// ends leaves at once and its order is not written; once one has, the
// request waits for the statement's outcome whatever its own deadline, and
// a committed order is answered 201 even if late — never the 503 that
// would tell the client to send it again.
type orderWriter struct {
	db          *pgxpool.Pool
	maxInFlight int
	// margin: the least of its budget a request must have left for its
	// order to join a statement (timeouts.commitMargin).
	margin time.Duration
	// statement bounds a statement once it runs (timeouts.orderStatement),
	// instead of its requests' deadlines; 0: no bound but the server's.
	statement time.Duration

	mu       sync.Mutex
	inFlight int           // statements running
	waiting  []*orderBatch // batches filling, in the order they will run
}

// orderBatch is the orders of one statement.
type orderBatch struct {
	rows  []*orderRow
	start chan struct{} // closed when a slot is this batch's
	done  chan struct{} // closed once every row has its outcome
	// Under orderWriter.mu:
	running bool // one of the batch's requests took the statement on
	waiting int  // the batch's requests that have not left
}

// orderRow is one request's order in a batch, and its outcome.
type orderRow struct {
	ctx         context.Context // the request's: a row whose request gave up before the statement is left out
	publicID    uuid.UUID
	customer    string
	items       string // JSON
	totalCents  int64
	key, hash   string // "" without an Idempotency-Key
	payload     string // order.created without createdAt (appendOrderCreated)
	traceparent string

	id        int64
	createdAt time.Time
	err       error

	// Under orderWriter.mu, each set once: the statement took the order
	// (its request waits for the outcome), or its request left (the order
	// is never written).
	taken, left bool
}

// newOrderWriter lets half the pool's connections write orders at once: the
// others stay for delivery, streams and reads.
func newOrderWriter(db *pgxpool.Pool, t timeouts) *orderWriter {
	return &orderWriter{db: db, maxInFlight: max(1, int(db.Config().MaxConns)/2), margin: t.commitMargin, statement: t.orderStatement}
}

// create writes the order req with publicID atomically with its
// order.created event and returns it as stored. A public id or key that is
// taken is errOrderConflict.
func (w *orderWriter) create(ctx context.Context, publicID uuid.UUID, req newOrder, key, hash string) (order, error) {
	o := order{PublicID: publicID, Customer: req.Customer, Items: req.Items, TotalCents: req.total()}
	items, _ := json.Marshal(req.Items) // strings and ints always encode
	row := &orderRow{ctx: ctx, publicID: publicID, customer: o.Customer, items: string(items), totalCents: o.TotalCents,
		key: key, hash: hash, traceparent: traceparentOf(ctx),
		payload: string(appendOrderCreated(make([]byte, 0, 96), o.TotalCents, len(o.Items)))}

	answer := func() (order, error) {
		if row.err != nil {
			return order{}, row.err
		}
		o.ID, o.CreatedAt = row.id, row.createdAt.UTC()
		return o, nil
	}
	b := w.join(row)
	if b == nil {
		return order{}, errNoTimeToCommit
	}
	select {
	case <-b.start:
		if ctx.Err() == nil {
			if live, ok := w.takeOn(b); ok {
				w.run(b, live)
				return answer()
			}
		}
	case <-b.done:
		return answer()
	case <-ctx.Done():
	}
	select { // another request of the batch runs it
	case <-b.done:
		return answer()
	case <-ctx.Done():
		if w.leave(b, row) {
			return order{}, fmt.Errorf("creating the order: %w", ctx.Err())
		}
		<-b.done // the statement took the order: its outcome is the answer, however late
		return answer()
	}
}

// inTime says whether r's request has at least the margin of its budget left.
func (w *orderWriter) inTime(r *orderRow, now time.Time) bool {
	d, ok := r.ctx.Deadline()
	return r.ctx.Err() == nil && (!ok || d.Sub(now) >= w.margin)
}

// join puts row in a batch: one that can run at once, the last waiting one,
// or a new one; nil when its request has too little time left to join any.
func (w *orderWriter) join(row *orderRow) *orderBatch {
	if !w.inTime(row, time.Now()) {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if n := len(w.waiting); n > 0 && len(w.waiting[n-1].rows) < maxOrderBatch {
		b := w.waiting[n-1]
		b.rows = append(b.rows, row)
		b.waiting++
		return b
	}
	b := &orderBatch{rows: []*orderRow{row}, start: make(chan struct{}), done: make(chan struct{}), waiting: 1}
	if len(w.waiting) == 0 && w.inFlight < w.maxInFlight {
		w.inFlight++
		close(b.start)
	} else {
		w.waiting = append(w.waiting, b)
	}
	return b
}

// takeOn says whether this request runs b's statement (the first to ask
// does) and which orders the statement takes: those whose requests are still
// there with at least the margin left. The others are answered
// errNoTimeToCommit, or have left.
func (w *orderWriter) takeOn(b *orderBatch) (live []*orderRow, ok bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if b.running {
		return nil, false
	}
	b.running = true
	now := time.Now()
	for _, r := range b.rows {
		switch {
		case r.left:
		case w.inTime(r, now):
			r.taken = true
			live = append(live, r)
		default:
			r.err = errNoTimeToCommit
		}
	}
	return live, true
}

// leave takes a request that gave up out of b, unless the statement already
// took its order (false: the request must wait for the outcome). The last
// one to leave a batch nobody runs takes it out of the queue, or passes its
// slot on.
func (w *orderWriter) leave(b *orderBatch, row *orderRow) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if row.taken {
		return false
	}
	row.left = true
	if b.waiting--; b.waiting > 0 || b.running {
		return true
	}
	if i := slices.Index(w.waiting, b); i >= 0 {
		w.waiting = slices.Delete(w.waiting, i, i+1)
		return true
	}
	w.handOverLocked() // the slot was b's
	return true
}

// run writes the live rows of b, hands the slot to the next batch and tells
// every row.
func (w *orderWriter) run(b *orderBatch, live []*orderRow) {
	defer close(b.done)
	defer w.handOver()
	if len(live) == 0 {
		return
	}
	// The statement is the whole batch's, and each of its requests waits for
	// it: no request's cancellation or deadline stops it, only its own bound.
	ctx := context.WithoutCancel(live[0].ctx)
	if w.statement > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, w.statement)
		defer cancel()
	}
	err := w.writeOn(ctx, live)
	if err != nil && len(live) > 1 && refusedByData(err) {
		// One order the database refuses (a check, a value) must not fail
		// the orders that shared its statement: each is written alone, as it
		// would have been without company.
		for _, r := range live {
			if err := w.writeOn(ctx, []*orderRow{r}); err != nil {
				r.err = err
			}
		}
		return
	}
	var unknown *statementUnknown
	if errors.As(err, &unknown) {
		w.settle(live, unknown)
		return
	}
	if err != nil {
		for _, r := range live {
			r.err = err
		}
	}
}

// statementUnknown is a statement that was sent and then interrupted (its
// connection lost, its bound reached) before the server's answer: its
// orders may have committed. backend is the server process that ran it.
type statementUnknown struct {
	backend uint32
	err     error
}

func (e *statementUnknown) Error() string { return e.err.Error() }
func (e *statementUnknown) Unwrap() error { return e.err }

// errOutcomeUnknown is an order whose statement was interrupted and whose
// fate the database could not be asked about: it may be stored. Its request
// is answered 504 outcome_unknown with the order's id and read token, never
// a "retry" that would store it twice.
var errOutcomeUnknown = errors.New("the database did not confirm whether the order was stored")

// writeOn runs the statement for rows on a connection of its own, so that
// an interrupted statement can be settled: the server process that ran it
// is known. An error before the statement was sent is returned as it is
// (nothing can have committed); one after it, without the server's answer,
// is a *statementUnknown.
func (w *orderWriter) writeOn(ctx context.Context, rows []*orderRow) error {
	conn, err := w.db.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("creating the orders: %w", err)
	}
	defer conn.Release()
	// Prepared first, once per connection (pgx keeps it by name): a failure
	// here is before the statement ran, so nothing can have committed, and
	// then the statement itself is a single round trip.
	if _, err := conn.Conn().Prepare(ctx, "insertOrdersAndEvents", insertOrdersAndEvents); err != nil {
		return fmt.Errorf("preparing the orders' statement: %w", err)
	}
	err = w.write(ctx, conn, rows)
	var pgErr *pgconn.PgError
	if err != nil && !errors.As(err, &pgErr) && !pgconn.SafeToRetry(err) {
		return &statementUnknown{backend: conn.Conn().PgConn().PID(), err: err}
	}
	return err
}

// settle finds out which orders of an interrupted statement committed, in
// two steps on another connection: first the server process that ran the
// statement is ended and waited for (pg_terminate_backend with a timeout),
// so that it can commit nothing later; then the orders are looked up. Only
// then is an order missing from the table not stored, and its request may be
// told to retry. If either step fails (the database hangs), the orders keep
// errOutcomeUnknown. It has a budget of its own, the statement's bound: the
// requests' may be spent.
//
// Ending a process by its pid alone: PostgreSQL gives pids out again only
// after the operating system does, which counts up through pid_max first.
func (w *orderWriter) settle(rows []*orderRow, interrupted *statementUnknown) {
	ctx := context.WithoutCancel(rows[0].ctx)
	if w.statement > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, w.statement)
		defer cancel()
	}
	unknown := fmt.Errorf("%w: %w", errOutcomeUnknown, interrupted)
	ids := make([]pgtype.UUID, len(rows))
	byID := make(map[uuid.UUID]*orderRow, len(rows))
	for i, r := range rows {
		ids[i], byID[r.publicID], r.err = pgtype.UUID{Bytes: r.publicID, Valid: true}, r, unknown
	}
	// Half of the budget for the old process to end: the look-up needs the rest.
	waitMs := int64(time.Until(deadlineOr(ctx, time.Now().Add(time.Second))) / time.Millisecond / 2)
	var ended bool
	err := w.db.QueryRow(ctx, `SELECT pg_terminate_backend($1, $2) OR NOT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1)`,
		int32(interrupted.backend), max(waitMs, 1)).Scan(&ended)
	if err != nil || !ended {
		return // the statement may still commit: its orders stay unknown
	}
	res, err := w.db.Query(ctx, `SELECT id, public_id, created_at FROM orders WHERE public_id = ANY ($1)`, ids)
	if err != nil {
		return
	}
	for _, r := range rows {
		r.err = fmt.Errorf("the order's statement was interrupted and did not commit: %w", interrupted.err)
	}
	if err := readWritten(res, byID); err != nil {
		for _, r := range rows {
			if r.id == 0 {
				r.err = unknown
			}
		}
	}
}

// deadlineOr is ctx's deadline, or fallback when it has none.
func deadlineOr(ctx context.Context, fallback time.Time) time.Time {
	if d, ok := ctx.Deadline(); ok {
		return d
	}
	return fallback
}

// refusedByData reports a statement the database refused for what a row
// holds (data exception, integrity constraint violation), not for its own
// state: another statement without that row would succeed.
func refusedByData(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23"))
}

// handOver gives the slot of a finished statement to the oldest waiting
// batch, or frees it.
func (w *orderWriter) handOver() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.handOverLocked()
}

func (w *orderWriter) handOverLocked() {
	if len(w.waiting) == 0 {
		w.inFlight--
		return
	}
	next := w.waiting[0]
	w.waiting[0] = nil
	w.waiting = w.waiting[1:]
	close(next.start)
}

// insertOrdersAndEvents writes a batch of orders and their order.created
// events in one statement: atomic like a transaction, one round trip and one
// commit for the batch. A row whose public id or Idempotency-Key is taken is
// skipped (ON CONFLICT DO NOTHING, so the others still commit) and has no
// event; its request finds out by its absence from the result. Events are
// numbered in order id order. Each payload's createdAt is its order's
// created_at, rendered as encoding/json renders a UTC time.Time (RFC 3339,
// fraction without trailing zeros).
var insertOrdersAndEvents = `WITH o AS (
	INSERT INTO orders (public_id, customer, items, total_cents, idempotency_key, request_hash)
	SELECT r.public_id, r.customer, r.items::jsonb, r.total_cents, NULLIF(r.key, ''), NULLIF(r.hash, '')
	FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[]) WITH ORDINALITY
		AS r(public_id, customer, items, total_cents, key, hash, n)
	ORDER BY r.n
	ON CONFLICT DO NOTHING
	RETURNING id, public_id, created_at, created_at AT TIME ZONE 'UTC' AS utc
), e AS (
	INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, traceparent)
	SELECT 'order', o.id::text, $7, p.payload::jsonb || jsonb_build_object('createdAt', ` + sqlJSONTime("o.utc") + `), NULLIF(p.traceparent, '')
	FROM o JOIN unnest($1::uuid[], $8::text[], $9::text[]) AS p(public_id, payload, traceparent) ON p.public_id = o.public_id
	ORDER BY o.id
)
SELECT id, public_id, created_at FROM o`

// write runs insertOrdersAndEvents for rows on conn and gives each its
// outcome; an error is the statement's, for every row.
func (w *orderWriter) write(ctx context.Context, conn *pgxpool.Conn, rows []*orderRow) error {
	n := len(rows)
	ids, customers, items, totals := make([]pgtype.UUID, n), make([]string, n), make([]string, n), make([]int64, n)
	keys, hashes, payloads, traceparents := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	byID := make(map[uuid.UUID]*orderRow, n)
	for i, r := range rows {
		// pgtype.UUID is sent in binary; uuid.UUID would go through driver.Valuer and a string.
		ids[i] = pgtype.UUID{Bytes: r.publicID, Valid: true}
		customers[i], items[i], totals[i] = r.customer, r.items, r.totalCents
		keys[i], hashes[i], payloads[i], traceparents[i] = r.key, r.hash, r.payload, r.traceparent
		byID[r.publicID] = r
		r.err = errOrderConflict // until the statement returns its row
	}
	res, err := conn.Query(ctx, "insertOrdersAndEvents", ids, customers, items, totals, keys, hashes,
		eventOrderCreated, payloads, traceparents)
	if err == nil {
		err = readWritten(res, byID)
	}
	if err != nil {
		return fmt.Errorf("creating the orders: %w", err)
	}
	return nil
}

// readWritten gives each order of res (id, public_id, created_at) to its
// row in byID, as written.
func readWritten(res pgx.Rows, byID map[uuid.UUID]*orderRow) error {
	defer res.Close()
	for res.Next() {
		var id int64
		var publicID pgtype.UUID
		var createdAt time.Time
		if err := res.Scan(&id, &publicID, &createdAt); err != nil {
			return fmt.Errorf("reading the written orders: %w", err)
		}
		if r := byID[publicID.Bytes]; r != nil {
			r.id, r.createdAt, r.err = id, createdAt, nil
		}
	}
	return res.Err()
}
