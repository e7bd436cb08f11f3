package main

// (issue 50) A slow or hung shared PostgreSQL, behind Toxiproxy, at the
// process level: what a client is told about its order is true.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2/client"
	"github.com/jackc/pgx/v5"
)

// An order is stored if and only if its client was told 201, or told 504
// outcome_unknown with the order's id and read token, which then tell it
// whether the order was stored. Never a 503 ("retry shortly") for an order
// that is stored: a client that obeys it would order twice. Latency slows
// orders down before it fails them (the request's budget is seconds): with
// 150 ms added to every answer of the database, at least 90 % are 201.
// Orders with and without an Idempotency-Key, at 80, 150, 300 and 600 ms
// and across the onset of a full hang (the database's answers and requests
// both swallowed).
func TestOrdersSlowDatabaseStoredIffTold(t *testing.T) {
	t.Parallel()
	env, direct, pgProxy := slowDatabaseEnv(t)
	p := startProc(t, env)
	_, api := p.waitReady()
	client := &http.Client{Timeout: 60 * time.Second}

	// sent is one order and what its client was told.
	type sent struct {
		level, customer, key string
		a                    answer
	}
	var all []sent
	// post sends n orders, one every 25 ms whatever the answers (open loop,
	// as clients do), half of them with an Idempotency-Key; atOrder is
	// called once, just before order number at is sent.
	post := func(level string, n, at int, atOrder func()) []sent {
		orders := make([]sent, n)
		var wg sync.WaitGroup
		tick := time.NewTicker(25 * time.Millisecond)
		defer tick.Stop()
		for i := range n {
			if i == at && atOrder != nil {
				atOrder()
			}
			o := sent{level: level, customer: fmt.Sprintf("slowdb %s %02d", level, i)}
			if i%2 == 1 {
				o.key = "slowdb-" + level + "-" + fmt.Sprint(i)
			}
			wg.Go(func() {
				body := fmt.Sprintf(`{"customer":%q,"items":[{"sku":"tea","qty":1,"priceCents":250}]}`, o.customer)
				req, _ := http.NewRequest(http.MethodPost, api+"/api/orders", strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				if o.key != "" {
					req.Header.Set("Idempotency-Key", o.key)
				}
				o.a = do(client, req)
				orders[i] = o
			})
			<-tick.C
		}
		wg.Wait()
		return orders
	}
	// tally is one level's answers by status, and the slowest 201.
	tally := func(orders []sent) (byStatus map[int]int, slowest201 time.Duration) {
		byStatus = map[int]int{}
		for _, o := range orders {
			byStatus[o.a.status]++
			if o.a.status == http.StatusCreated {
				slowest201 = max(slowest201, o.a.took)
			}
		}
		return byStatus, slowest201
	}

	for _, latency := range []int{80, 150, 300, 600} {
		level := fmt.Sprintf("%dms", latency)
		if _, err := pgProxy.AddToxic("slow", "latency", "downstream", 1, toxiproxy.Attributes{"latency": latency}); err != nil {
			t.Fatalf("adding %d ms of latency: %v", latency, err)
		}
		orders := post(level, 24, -1, nil)
		if err := removeToxic(pgProxy, "slow"); err != nil {
			t.Fatalf("removing the latency: %v", err)
		}
		byStatus, slowest := tally(orders)
		t.Logf("PostgreSQL %4d ms slower: answers %v, the slowest 201 after %s", latency, byStatus, slowest.Round(time.Millisecond))
		if latency == 150 && byStatus[http.StatusCreated] < len(orders)*9/10 {
			t.Errorf("PostgreSQL 150 ms slower: %d of %d orders answered 201, want at least 90 %%: %v",
				byStatus[http.StatusCreated], len(orders), byStatus)
		}
		all = append(all, orders...)
	}

	// The onset of a hang: orders already in flight when the database stops
	// answering, and some sent after. The hang lasts until every order is
	// answered (within two budgets: the statement's and its settling's).
	var restore func()
	orders := post("hung", 16, 6, func() { restore = blackHole(t, pgProxy) })
	restore()
	byStatus, _ := tally(orders)
	t.Logf("PostgreSQL hung from the 7th order on: answers %v", byStatus)
	all = append(all, orders...)

	// The truth, read past the proxy.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db, err := pgx.Connect(ctx, direct)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close(context.Background())
	stored := map[string]string{} // customer → public id
	rows, _ := db.Query(ctx, `SELECT customer, public_id::text FROM orders WHERE customer LIKE 'slowdb %'`)
	var customer, id string
	if _, err := pgx.ForEachRow(rows, []any{&customer, &id}, func() error {
		if _, twice := stored[customer]; twice {
			t.Errorf("%q is stored twice", customer)
		}
		stored[customer] = id
		return nil
	}); err != nil {
		t.Fatalf("reading the orders: %v", err)
	}

	var unknown int
	for _, o := range all {
		storedID, isStored := stored[o.customer]
		switch o.a.status {
		case http.StatusCreated:
			if !isStored || o.a.orderID() != storedID {
				t.Errorf("%s (key %q): answered 201 with order %q, stored as %q (%t)", o.customer, o.key, o.a.orderID(), storedID, isStored)
			}
		case http.StatusGatewayTimeout:
			unknown++
			var body struct {
				Error     errorBody
				ID        string
				ReadToken string
			}
			if err := json.Unmarshal(o.a.body, &body); err != nil || body.Error.Code != "outcome_unknown" || body.ID == "" || body.ReadToken == "" {
				t.Errorf("%s: a 504 without the order's id and read token: %s", o.customer, o.a.body)
				continue
			}
			if isStored && body.ID != storedID {
				t.Errorf("%s: the 504 names order %s, stored as %s", o.customer, body.ID, storedID)
			}
			// What the client does next: look it up.
			req, _ := http.NewRequest(http.MethodGet, api+"/api/orders/"+body.ID, nil)
			req.Header.Set("Authorization", "Bearer "+body.ReadToken)
			want := map[bool]int{true: http.StatusOK, false: http.StatusNotFound}[isStored]
			if got := do(client, req); got.status != want {
				t.Errorf("%s: answered 504 outcome_unknown, stored %t; looking it up gave %s, want %d", o.customer, isStored, got, want)
			}
		default:
			if isStored {
				t.Errorf("%s (key %q): stored as %s behind %s %s", o.customer, o.key, storedID, o.a, o.a.body)
			}
			if o.a.status != http.StatusServiceUnavailable || o.a.retryAfter == "" {
				t.Errorf("%s: %s %s; want 201, 504 outcome_unknown, or 503 with Retry-After", o.customer, o.a, o.a.body)
			}
		}
	}
	t.Logf("%d orders sent, %d stored, %d answered outcome_unknown", len(all), len(stored), unknown)
}

// A drain while the shared PostgreSQL is slow (600 ms added to every answer)
// loses nothing and says so: exit 0. The outbox batch in hand may not finish
// within the poller's share: it rolls back, its events stay pending for the
// next poller, and that costs the exit code nothing. The draining state
// change reaches the outbox: River's fetches have a pool of their own, so
// the record finds a free connection (it did not when they shared one).
func TestDrainWithASlowDatabaseExitsZero(t *testing.T) {
	t.Parallel()
	env, direct, pgProxy := slowDatabaseEnv(t)
	env["KUMIKO_SHUTDOWN_TIMEOUT"] = "40s" // the default: the releases' shares are derived from it
	env["KUMIKO_DRAIN_TIMEOUT"] = "30s"
	p := startProc(t, env)
	_, api := p.waitReady()
	client := &http.Client{Timeout: 30 * time.Second}
	if _, err := pgProxy.AddToxic("slow", "latency", "downstream", 1, toxiproxy.Attributes{"latency": 600}); err != nil {
		t.Fatal(err)
	}
	for _, a := range concurrently(4, func(int) answer { return postOrder(client, api, "") }) {
		if a.status != http.StatusCreated {
			t.Errorf("an order with PostgreSQL 600 ms slower: %s %s", a, a.body)
		}
	}
	sent := time.Now()
	p.signal(syscall.SIGTERM)
	code := p.wait(60 * time.Second)
	t.Logf("SIGTERM → exit %d in %s", code, time.Since(sent).Round(time.Millisecond))
	for _, l := range p.logsMatching(map[string]any{"msg": "lifecycle"}) {
		if l["step"] != nil {
			t.Logf("step %v: %v ms %v", l["step"], l["duration_ms"], l["error"])
		}
	}
	if code != 0 {
		t.Errorf("exit code %d with a slow but working database, want 0:\n%s", code, p.stderr.String())
	}
	if err := removeToxic(pgProxy, "slow"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	db, err := pgx.Connect(ctx, direct)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close(context.Background())
	var draining int
	if err := db.QueryRow(ctx, `SELECT count(*) FROM outbox_events WHERE event_type = $1 AND aggregate_id = $2 AND payload->>'to' = 'draining'`,
		eventInstanceStateChanged, env["KUMIKO_INSTANCE_ID"]).Scan(&draining); err != nil {
		t.Fatal(err)
	}
	if draining != 1 {
		t.Errorf("draining events recorded: %d, want 1", draining)
	}
}

// slowDatabaseEnv is a service's environment with Toxiproxy between it and
// PostgreSQL: the proxy to put toxics on, and the direct URL to read the truth.
func slowDatabaseEnv(t *testing.T) (env map[string]string, direct string, pgProxy *toxiproxy.Proxy) {
	t.Helper()
	tp := testToxiproxy(t)
	env = fastEnv(t)
	direct = env["DATABASE_URL"]
	pgProxy = proxyTo(t, tp, "postgres", must(url.Parse(direct)).Host)
	env["DATABASE_URL"] = withHost(t, direct, pgProxy.Listen)
	return env, direct, pgProxy
}
