package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
)

// testOrder is an order body as decodeOrder would return it.
var testOrder = newOrder{Customer: "Ada", Items: []orderItem{{SKU: "tea", Qty: 2, PriceCents: 250}, {SKU: "cake", Qty: 1, PriceCents: 400}}}

// waitForWaiting waits until w's waiting batches hold n orders.
func waitForWaiting(t *testing.T, w *orderWriter, n int) {
	t.Helper()
	var got int
	if !poll(10*time.Second, time.Millisecond, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		got = 0
		for _, b := range w.waiting {
			got += len(b.rows)
		}
		return got == n
	}) {
		t.Fatalf("%d orders waiting, want %d", got, n)
	}
}

// waitForRunning waits until w's one statement slot is taken.
func waitForRunning(t *testing.T, w *orderWriter) {
	t.Helper()
	var running int
	if !poll(10*time.Second, time.Millisecond, func() bool {
		w.mu.Lock()
		defer w.mu.Unlock()
		running = w.inFlight
		return running == 1
	}) {
		t.Fatalf("the first order did not start its statement: %d statements running, want 1", running)
	}
}

// occupySlot takes w's one statement slot with an order (in wg) whose
// insert waits until release: the orders created after it gather in a batch.
func occupySlot(t *testing.T, s *inProcess, w *orderWriter, wg *sync.WaitGroup) (release func()) {
	t.Helper()
	release = holdOrders(t, s)
	wg.Go(func() {
		if _, err := w.create(context.Background(), uuid.Must(uuid.NewV7()), testOrder, "", ""); err != nil {
			t.Error(err)
		}
	})
	waitForRunning(t, w)
	return release
}

// countOrderEvents counts the order.created events (the instance writes
// events of its own, such as its state changes).
func countOrderEvents(t *testing.T, s *inProcess) int {
	t.Helper()
	var n int
	if err := s.app.db.QueryRow(context.Background(), `SELECT count(*) FROM outbox_events WHERE event_type = $1`, eventOrderCreated).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// holdOrders blocks every insert into orders until the returned func is called.
func holdOrders(t *testing.T, s *inProcess) (release func()) {
	t.Helper()
	tx, err := s.app.db.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(context.Background(), `LOCK TABLE orders IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	return func() { tx.Rollback(context.Background()) }
}

// Orders that arrive while a statement runs share the next one, and each
// still gets its own row, its own event with its own trace, and its answer.
func TestOrderWriterSharesAStatement(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	w := &orderWriter{db: s.app.db, maxInFlight: 1}
	ctx := context.Background()
	release := holdOrders(t, s)

	const n = 10
	type result struct {
		o           order
		traceparent string
		err         error
	}
	results := make([]result, n+1)
	var wg sync.WaitGroup
	create := func(i int) {
		defer wg.Done()
		tp := fmt.Sprintf("00-%032x-%016x-01", i+1, i+1)
		o, err := w.create(withTraceparent(ctx, tp), uuid.Must(uuid.NewV7()), testOrder, "", "")
		results[i] = result{o, tp, err}
	}
	wg.Add(1)
	go create(0) // the first writes at once, and waits for the lock
	waitForRunning(t, w)
	for i := 1; i <= n; i++ {
		wg.Add(1)
		go create(i)
	}
	waitForWaiting(t, w, n)
	release()
	wg.Wait()

	batchTime := results[1].o.CreatedAt
	for i, r := range results {
		if r.err != nil {
			t.Fatalf("order %d: %v", i, r.err)
		}
		// now() is the statement's transaction time: one statement, one time.
		if i > 0 && !r.o.CreatedAt.Equal(batchTime) {
			t.Errorf("order %d created at %s, the batch at %s: not one statement", i, r.o.CreatedAt, batchTime)
		}
		var id int64
		var traceparent, payloadID, payloadCreated string
		err := s.app.db.QueryRow(ctx, `SELECT o.id, coalesce(e.traceparent, ''), coalesce(e.payload->>'id', ''), e.payload->>'createdAt'
			FROM orders o JOIN outbox_events e ON e.aggregate_type = 'order' AND e.aggregate_id = o.id::text
			WHERE o.public_id = $1`, r.o.PublicID).Scan(&id, &traceparent, &payloadID, &payloadCreated)
		// The event is the order's own (joined by aggregate id) and public: no order id in it.
		if err != nil || id != r.o.ID || traceparent != r.traceparent || payloadID != "" ||
			payloadCreated != r.o.CreatedAt.Format(time.RFC3339Nano) {
			t.Errorf("order %d (%d, %s): stored %d, event traceparent %q (want %q), payload id %s createdAt %s (%v)",
				i, r.o.ID, r.o.CreatedAt.Format(time.RFC3339Nano), id, traceparent, r.traceparent, payloadID, payloadCreated, err)
		}
	}
	if w.inFlight != 0 || len(w.waiting) != 0 {
		t.Fatalf("after the batches: %d running, %d waiting", w.inFlight, len(w.waiting))
	}
}

// In one statement, an order whose Idempotency-Key or public id is taken
// (also by another order of the same statement) is errOrderConflict and
// writes no event; the others commit. An order whose request gave up while
// it waited is not written at all.
func TestOrderWriterConflictsAndGivenUpRequestsInABatch(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	w := &orderWriter{db: s.app.db, maxInFlight: 1}
	ctx := context.Background()
	taken := uuid.Must(uuid.NewV7())
	if _, err := w.create(ctx, taken, testOrder, "", ""); err != nil {
		t.Fatal(err)
	}
	events := countOrderEvents(t, s)
	var wg sync.WaitGroup
	release := occupySlot(t, s, w, &wg)
	gaveUp, giveUp := context.WithCancel(ctx)
	cases := []struct {
		ctx      context.Context
		publicID uuid.UUID
		key      string
		want     error
	}{
		{ctx, uuid.Must(uuid.NewV7()), "k1", nil},
		{ctx, uuid.Must(uuid.NewV7()), "k1", errOrderConflict}, // the same key, later in the same statement
		{ctx, taken, "", errOrderConflict},
		{gaveUp, uuid.Must(uuid.NewV7()), "", context.Canceled},
		{ctx, uuid.Must(uuid.NewV7()), "", nil},
	}
	errs := make([]error, len(cases))
	for i, c := range cases {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = w.create(c.ctx, c.publicID, testOrder, c.key, "hash")
		}()
		waitForWaiting(t, w, i+1) // in this order
	}
	giveUp() // whether it leaves the batch first or the statement skips it, its order is not written
	release()
	wg.Wait()
	for i, c := range cases {
		if (c.want == nil) != (errs[i] == nil) || (c.want != nil && !errors.Is(errs[i], c.want)) {
			t.Errorf("case %d: %v, want %v", i, errs[i], c.want)
		}
	}
	var written int
	if err := s.app.db.QueryRow(ctx, `SELECT count(*) FROM orders WHERE public_id = ANY ($1)`,
		[]uuid.UUID{cases[0].publicID, cases[1].publicID, cases[3].publicID, cases[4].publicID}).Scan(&written); err != nil || written != 2 {
		t.Fatalf("%d of the batch's new orders written (%v), want 2", written, err)
	}
	if got := countOrderEvents(t, s); got != events+3 { // the slot holder's and the batch's two
		t.Fatalf("%d events written, want %d: one per written order", got-events, 3)
	}
}

// A request that gives up while its batch waits leaves at once, whether it
// opened the batch or not; the batch still runs for the others, and a batch
// everyone left gives its turn away.
func TestOrderWriterRequestsThatGiveUpLeaveAtOnce(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	w := &orderWriter{db: s.app.db, maxInFlight: 1}
	ctx := context.Background()
	var wg sync.WaitGroup
	release := occupySlot(t, s, w, &wg)
	opener, giveUp := context.WithTimeout(ctx, 50*time.Millisecond)
	defer giveUp()
	var openerErr, stayerErr error
	stayer := uuid.Must(uuid.NewV7())
	openerLeft := make(chan struct{})
	wg.Add(2)
	go func() {
		defer wg.Done()
		defer close(openerLeft)
		_, openerErr = w.create(opener, uuid.Must(uuid.NewV7()), testOrder, "", "")
	}()
	waitForWaiting(t, w, 1)
	go func() {
		defer wg.Done()
		_, stayerErr = w.create(ctx, stayer, testOrder, "", "")
	}()
	waitForWaiting(t, w, 2)
	// The statement ahead holds the slot until release: an opener that waited
	// for its batch's turn would not be back before it.
	select {
	case <-openerLeft:
	case <-time.After(10 * time.Second):
		t.Fatal("the batch's opener still waits 10s after its deadline, behind the statement ahead")
	}
	release()
	wg.Wait()
	if !errors.Is(openerErr, context.DeadlineExceeded) {
		t.Fatalf("the batch's opener gave up with %v, want its deadline", openerErr)
	}
	if stayerErr != nil || countRows(t, s, "orders WHERE public_id = '"+stayer.String()+"'") != 1 {
		t.Fatalf("the request that stayed: %v", stayerErr)
	}

	// A batch everyone left: the next request still gets a slot.
	release = occupySlot(t, s, w, &wg)
	gone, cancel := context.WithCancel(ctx)
	wg.Add(1)
	go func() {
		defer wg.Done()
		if _, err := w.create(gone, uuid.Must(uuid.NewV7()), testOrder, "", ""); !errors.Is(err, context.Canceled) {
			t.Errorf("a request that gave up: %v", err)
		}
	}()
	waitForWaiting(t, w, 1)
	cancel()
	waitForWaiting(t, w, 0)
	release()
	wg.Wait()
	if _, err := w.create(ctx, uuid.Must(uuid.NewV7()), testOrder, "", ""); err != nil || w.inFlight != 0 || len(w.waiting) != 0 {
		t.Fatalf("after the batches: %v, %d running, %d waiting", err, w.inFlight, len(w.waiting))
	}
}

// An order the database refuses (here a customer its check does not allow)
// fails alone: the orders that shared its statement are written one by one
// and commit, each with its event.
func TestOrderWriterARefusedOrderFailsAlone(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	w := &orderWriter{db: s.app.db, maxInFlight: 1}
	ctx := context.Background()
	events := countOrderEvents(t, s)
	var wg sync.WaitGroup
	release := occupySlot(t, s, w, &wg)

	refused := testOrder
	refused.Customer = "" // decodeOrder never lets this through; the database's check is the last word
	bodies := []newOrder{testOrder, refused, testOrder}
	errs := make([]error, len(bodies))
	for i, body := range bodies {
		wg.Go(func() { _, errs[i] = w.create(ctx, uuid.Must(uuid.NewV7()), body, "", "") })
		waitForWaiting(t, w, i+1)
	}
	release()
	wg.Wait()
	var pgErr *pgconn.PgError
	if errs[0] != nil || errs[2] != nil || !errors.As(errs[1], &pgErr) || pgErr.Code != "23514" {
		t.Fatalf("outcomes %v; want nil, a check violation (23514), nil", errs)
	}
	if got := countOrderEvents(t, s); got != events+3 { // the slot holder's and the two accepted
		t.Fatalf("%d events written, want 3: one per written order", got-events)
	}
}

// A request with less than the writer's margin left never starts a
// statement nor joins one: at once when it asks, and when the statement
// that would have taken its order starts too late for it. The orders that
// shared its batch are still written.
func TestOrderWriterStartsNoStatementWithoutTimeToAnswer(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	w := &orderWriter{db: s.app.db, maxInFlight: 1, margin: 10 * time.Second}
	before := countRows(t, s, "orders")

	short, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := w.create(short, uuid.Must(uuid.NewV7()), testOrder, "", ""); !errors.Is(err, errNoTimeToCommit) {
		t.Fatalf("an order with 5s left and a 10s margin: %v, want errNoTimeToCommit", err)
	}
	if w.inFlight != 0 || len(w.waiting) != 0 || countRows(t, s, "orders") != before {
		t.Fatalf("after it: %d statements running, %d batches waiting, %d orders written",
			w.inFlight, len(w.waiting), countRows(t, s, "orders")-before)
	}

	// Enough time when it joins the batch, too little when the batch starts.
	var wg sync.WaitGroup
	release := occupySlot(t, s, w, &wg)
	deadline := time.Now().Add(w.margin + 300*time.Millisecond)
	tight, cancelTight := context.WithDeadline(context.Background(), deadline)
	defer cancelTight()
	late, patient := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
	var lateErr, patientErr error
	wg.Go(func() { _, lateErr = w.create(tight, late, testOrder, "", "") })
	waitForWaiting(t, w, 1)
	wg.Go(func() { _, patientErr = w.create(context.Background(), patient, testOrder, "", "") })
	waitForWaiting(t, w, 2)
	// The batch's turn comes only once the margin is passed: a moment on the
	// wall clock, the one the request's deadline is on.
	if !poll(10*time.Second, time.Millisecond, func() bool { return time.Until(deadline) < w.margin }) {
		t.Fatalf("the margin never passed: %s to the deadline, margin %s", time.Until(deadline), w.margin)
	}
	release()
	wg.Wait()
	if !errors.Is(lateErr, errNoTimeToCommit) || countRows(t, s, "orders WHERE public_id = '"+late.String()+"'") != 0 {
		t.Fatalf("the order whose margin passed while it waited: %v, written %d times; want errNoTimeToCommit, never",
			lateErr, countRows(t, s, "orders WHERE public_id = '"+late.String()+"'"))
	}
	if patientErr != nil || countRows(t, s, "orders WHERE public_id = '"+patient.String()+"'") != 1 {
		t.Fatalf("the order beside it: %v", patientErr)
	}
}

// Once a statement has taken an order, its request waits for the outcome
// past its own deadline: a committed order is answered, never a deadline
// error that would have its client send it again. Whichever of the batch's
// requests runs the statement, the one whose budget ended gets its order.
func TestOrderWriterAnswersACommittedOrderPastItsDeadline(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	w := &orderWriter{db: s.app.db, maxInFlight: 1}
	ctx := context.Background()
	// holdKey inserts an order with key in a transaction left open: an
	// order with the same key waits for it in the database.
	holdKey := func(key string) (release func()) {
		tx, err := s.app.db.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO orders (public_id, customer, items, total_cents, idempotency_key)
			VALUES ($1, 'Held', '[]', 0, $2)`, uuid.Must(uuid.NewV7()), key); err != nil {
			t.Fatal(err)
		}
		return func() { tx.Rollback(ctx) }
	}
	// waitForBlockedStatement waits until an order statement waits for a lock.
	waitForBlockedStatement := func() {
		t.Helper()
		var n int
		if !poll(10*time.Second, time.Millisecond, func() bool {
			if err := s.app.db.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND query LIKE 'WITH o AS%'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n == 1
		}) {
			t.Fatalf("%d order statements waiting for a lock, want 1", n)
		}
	}
	releaseFirst, releaseBatch := holdKey("held-1"), holdKey("held-2")
	defer releaseBatch()
	first := make(chan error, 1)
	go func() { _, err := w.create(ctx, uuid.Must(uuid.NewV7()), testOrder, "held-1", "h"); first <- err }()
	waitForRunning(t, w)

	var wg sync.WaitGroup
	wg.Go(func() {
		if _, err := w.create(ctx, uuid.Must(uuid.NewV7()), testOrder, "held-2", "h"); err != nil {
			t.Error(err)
		}
	})
	waitForWaiting(t, w, 1)
	budget, endBudget := context.WithCancel(ctx)
	late := uuid.Must(uuid.NewV7())
	var got order
	var lateErr error
	wg.Go(func() { got, lateErr = w.create(budget, late, testOrder, "", "") })
	waitForWaiting(t, w, 2)

	releaseFirst()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	waitForBlockedStatement() // the batch's statement took both orders and waits for held-2
	endBudget()               // the request's budget ends while its order is in the statement
	releaseBatch()
	wg.Wait()
	if lateErr != nil || got.PublicID != late || got.ID == 0 {
		t.Fatalf("the order whose budget ended inside its statement: %+v, %v; want it answered as written", got, lateErr)
	}
	if n := countRows(t, s, "orders WHERE public_id = '"+late.String()+"'"); n != 1 {
		t.Fatalf("written %d times, want once", n)
	}
}
