package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"github.com/riverqueue/river"
)

const validOrder = `{"customer":"Ada","items":[{"sku":"tea","qty":2,"priceCents":250},{"sku":"cake","qty":1,"priceCents":400}]}`

// The order path's deadlines are shares of one request's dependency budget:
// the idempotency marker gives way after a quarter, an order joins a
// statement only with a fifth left, and a statement once running gets the
// whole budget again.
func TestOrderDeadlinesShareTheRequestBudget(t *testing.T) {
	c := defaultConfig()
	c.HTTP.DependencyTimeout = 400 * time.Millisecond
	got := newTimeouts(c)
	if got.marker != 100*time.Millisecond || got.commitMargin != 80*time.Millisecond || got.orderStatement != 400*time.Millisecond {
		t.Errorf("marker, commitMargin, orderStatement = %s, %s, %s; want 100ms, 80ms and 400ms of a 400ms budget",
			got.marker, got.commitMargin, got.orderStatement)
	}
}

// post sends a JSON body to the API and decodes the answer.
func post(t *testing.T, url, body string, header map[string]string) (int, http.Header, map[string]any) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	out := map[string]any{}
	_ = json.Unmarshal(raw, &out)
	return resp.StatusCode, resp.Header, out
}

// createOrder posts validOrder until it is created, as a client that
// honours Retry-After would, and returns the order. For tests where an order
// is the setup, not the subject: a 503 with Retry-After stored nothing
// (docs/overload.md), and a busy machine may answer one while the instance
// still opens its pool's connections. Anything else fails the test.
func createOrder(t *testing.T, api string) map[string]any {
	t.Helper()
	var code int
	var hdr http.Header
	var body map[string]any
	created := poll(10*time.Second, 100*time.Millisecond, func() bool {
		code, hdr, body = post(t, api+"/api/orders", validOrder, nil)
		if code != http.StatusCreated && (code != http.StatusServiceUnavailable || hdr.Get("Retry-After") == "") {
			t.Fatalf("POST /api/orders: %d %v", code, body)
		}
		return code == http.StatusCreated
	})
	if !created {
		t.Fatalf("POST /api/orders: still %d after 10 s of retries: %v", code, body)
	}
	return body
}

// keysOf is a JSON object's keys, sorted and space-separated.
func keysOf(m map[string]any) string {
	keys := slices.Sorted(maps.Keys(m))
	return strings.Join(keys, " ")
}

func countRows(t *testing.T, s *inProcess, table string) int {
	t.Helper()
	var n int
	if err := s.app.db.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestOrderCreateGetAndList(t *testing.T) {
	env := fastEnv(t, "KUMIKO_ADMIN_TOKEN="+testAdminToken)
	s := startInProcess(t, env)
	api := apiURL(s)
	code, hdr, created := post(t, api+"/api/orders", validOrder, nil)
	if code != 201 || created["totalCents"] != 900.0 || created["id"] == nil || hdr.Get("Cache-Control") != "no-store" {
		t.Fatalf("POST = %d %v (Cache-Control %q)", code, created, hdr.Get("Cache-Control"))
	}
	id, _ := created["id"].(string)
	token, _ := created["readToken"].(string)
	_, _, other := post(t, api+"/api/orders", `{"customer":"Bob","items":[{"sku":"x","qty":1,"priceCents":1}]}`, nil)

	// The order is read with its own token, and with nothing else: not
	// without one, not with another order's, not with the admin token (which
	// works on the ops port only).
	for _, tc := range []struct {
		name, method, path, auth string
		status                   int
	}{
		{"its token", "GET", id, "Bearer " + token, 200},
		{"its token, scheme in lower case, two spaces", "GET", id, "bearer  " + token, 200},
		{"HEAD with its token", "HEAD", id, "BEARER " + token, 200},
		{"no token", "GET", id, "", 401},
		{"another order's token", "GET", id, "Bearer " + fmt.Sprint(other["readToken"]), 401},
		{"the admin token", "GET", id, "Bearer " + testAdminToken, 401},
		{"a token but another scheme", "GET", id, "Basic " + token, 401},
		{"an order that does not exist", "GET", uuid.NewString(), "Bearer " + token, 401},
		{"upper case", "GET", strings.ToUpper(id), "Bearer " + token, 404},
		{"braces", "GET", "{" + id + "}", "Bearer " + token, 404},
		{"urn:uuid:", "GET", "urn:uuid:" + id, "Bearer " + token, 404},
		{"no dashes", "GET", strings.ReplaceAll(id, "-", ""), "Bearer " + token, 404},
		{"not an id", "GET", "999", "Bearer " + token, 404},
	} {
		req, _ := http.NewRequest(tc.method, api+"/api/orders/"+tc.path, nil)
		if tc.auth != "" {
			req.Header.Set("Authorization", tc.auth)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status {
			t.Errorf("%s: %s /api/orders/%s = %d %s, want %d", tc.name, tc.method, tc.path, resp.StatusCode, raw, tc.status)
		}
		if resp.StatusCode == 200 && (resp.Header.Get("Cache-Control") != "no-store" || (tc.method == "GET") != bytes.Contains(raw, []byte(`"customer":"Ada"`))) {
			t.Errorf("%s: %s answered %q (Cache-Control %q), want the whole order, not to be stored", tc.name, tc.method, raw, resp.Header.Get("Cache-Control"))
		}
		if resp.StatusCode == 401 && !strings.HasPrefix(resp.Header.Get("WWW-Authenticate"), "Bearer") {
			t.Errorf("%s: 401 without WWW-Authenticate: Bearer", tc.name)
		}
	}

	// No public listing and no public search: both answer names and items.
	for _, path := range []string{"/api/orders", "/api/orders?q=ad"} {
		if code, _, body, _ := get(t, http.DefaultClient, api+path); code != http.StatusMethodNotAllowed {
			t.Errorf("GET %s = %d %v, want 405: only POST is public there", path, code, body)
		}
	}
	// On the ops port, behind the admin token: the list, the search and any order.
	code, hdr, list := adminGet(t, opsURL(s), "/admin/orders")
	if orders, _ := list["orders"].([]any); code != 200 || len(orders) != 2 {
		t.Fatalf("admin list = %d %v", code, list)
	}
	code, hdr, list = adminGet(t, opsURL(s), "/admin/orders?q=ad")
	if code != 200 || hdr.Get("X-Search-Source") != "sql" || len(list["orders"].([]any)) != 1 || list["orders"].([]any)[0].(map[string]any)["customer"] != "Ada" {
		t.Fatalf("admin search = %d %v", code, list)
	}
	if code, _, got := adminGet(t, opsURL(s), "/admin/orders/"+id); code != 200 || got["customer"] != "Ada" || got["readToken"] != nil {
		t.Fatalf("admin GET of the order = %d %v", code, got)
	}
	for _, path := range []string{"/admin/orders?q=ad", "/admin/orders/" + id} {
		if code, _, _, _ := get(t, http.DefaultClient, opsURL(s)+path); code != 401 {
			t.Errorf("%s without the token = %d, want 401", path, code)
		}
	}

	// The order and its event were written together.
	var eventType, aggregate string
	err := s.app.db.QueryRow(context.Background(), `SELECT event_type, aggregate_id FROM outbox_events WHERE aggregate_type = 'order' ORDER BY id LIMIT 1`).Scan(&eventType, &aggregate)
	var internalID string
	s.app.db.QueryRow(context.Background(), `SELECT id::text FROM orders WHERE public_id = $1`, id).Scan(&internalID)
	if err != nil || eventType != "order.created" || aggregate != internalID {
		t.Fatalf("outbox row: %v %s %s (order %s)", err, eventType, aggregate, internalID)
	}
}

// Bad input gets the right 4xx with a JSON error body, and nothing is written.
func TestOrderBadInput(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	api := apiURL(s)
	for _, tc := range []struct {
		name, body, contentType string
		header                  map[string]string
		status                  int
		code, mentions          string
	}{
		{"malformed JSON", `{"customer":`, "", nil, 400, "invalid_json", ""},
		{"wrong type", `{"customer":"Ada","items":[{"sku":"tea","qty":"two","priceCents":1}]}`, "", nil, 400, "invalid_json", "qty"},
		{"unknown field", `{"customer":"Ada","items":[],"discount":5}`, "", nil, 400, "invalid_json", "discount"},
		{"trailing data", validOrder + `{}`, "", nil, 400, "invalid_json", ""},
		{"missing fields", `{}`, "", nil, 422, "validation_failed", "customer"},
		{"every problem at once", `{"customer":"","items":[{"sku":"","qty":0,"priceCents":-1}]}`, "", nil, 422, "validation_failed", "items[0].priceCents"},
		{"too many items", `{"customer":"Ada","items":[` + strings.Repeat(`{"sku":"a","qty":1,"priceCents":1},`, 100) + `{"sku":"a","qty":1,"priceCents":1}]}`, "", nil, 422, "validation_failed", "1 to 100"},
		{"oversized body", `{"customer":"` + strings.Repeat("x", 70<<10) + `","items":[]}`, "", nil, 413, "payload_too_large", ""},
		{"not JSON", validOrder, "text/plain", nil, 415, "unsupported_media_type", ""},
		{"bad idempotency key", validOrder, "", map[string]string{"Idempotency-Key": "schlüssel"}, 400, "invalid_idempotency_key", ""},
		{"invalid UTF-8", `{"customer":"Ad` + "\xff" + `a","items":[{"sku":"tea","qty":1,"priceCents":1}]}`, "", nil, 400, "invalid_json", "UTF-8"},
		{"NUL in customer", `{"customer":"Ad\u0000a","items":[{"sku":"tea","qty":1,"priceCents":1}]}`, "", nil, 422, "validation_failed", "customer"},
		{"control character in sku", `{"customer":"Ada","items":[{"sku":"t\u0007ea","qty":1,"priceCents":1}]}`, "", nil, 422, "validation_failed", "items[0].sku"},
		{"items as a string", `{"customer":"Ada","items":"tea"}`, "", nil, 400, "invalid_json", "items: expected an array"},
		{"body as an array", `[1]`, "", nil, 400, "invalid_json", "expected an object"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(http.MethodPost, api+"/api/orders", strings.NewReader(tc.body))
			ct := tc.contentType
			if ct == "" {
				ct = "application/json"
			}
			req.Header.Set("Content-Type", ct)
			for k, v := range tc.header {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			var body struct{ Error errorBody }
			json.NewDecoder(resp.Body).Decode(&body)
			if resp.StatusCode != tc.status || body.Error.Code != tc.code || !strings.Contains(body.Error.Message, tc.mentions) {
				t.Errorf("got %d %+v, want %d %s mentioning %q", resp.StatusCode, body.Error, tc.status, tc.code, tc.mentions)
			}
			// Error bodies speak JSON, not Go: no type names, no decoder internals.
			for _, leak := range []string{"main.", "Go ", "orderItem", "newOrder", "int64", "json:"} {
				if strings.Contains(body.Error.Message, leak) {
					t.Errorf("error message %q contains %q", body.Error.Message, leak)
				}
			}
		})
	}
	for path, want := range map[string]int{"/api/orders/" + uuid.NewString(): 401, "/api/orders/999": 404, "/api/orders/abc": 404} {
		if code, _, body, _ := get(t, http.DefaultClient, api+path); code != want || body["error"] == nil {
			t.Errorf("GET %s = %d %v, want %d with an error body", path, code, body, want)
		}
	}
	if n := countRows(t, s, "orders") + countRows(t, s, "outbox_events WHERE aggregate_type = 'order'"); n != 0 {
		t.Fatalf("bad input wrote %d rows", n)
	}
}

func TestOrderIdempotency(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	api := apiURL(s)
	key := map[string]string{"Idempotency-Key": "order-7f3a"}

	code1, _, first := post(t, api+"/api/orders", validOrder, key)
	code2, hdr, second := post(t, api+"/api/orders", validOrder, key)
	if code1 != 201 || code2 != 201 || hdr.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("first %d, retry %d (replayed %q)", code1, code2, hdr.Get("Idempotent-Replayed"))
	}
	if a, b := mustJSON(first), mustJSON(second); a != b {
		t.Fatalf("the retry answered differently:\n%s\n%s", a, b)
	}

	// A crash lost the Redis marker: the unique column still finds the first order.
	s.app.redis.FlushAll(context.Background())
	if code, _, third := post(t, api+"/api/orders", validOrder, key); code != 201 || mustJSON(third) != mustJSON(first) {
		t.Fatalf("after losing Redis: %d %v", code, third)
	}

	// The same key with another body is refused.
	if code, _, body := post(t, api+"/api/orders", `{"customer":"Bob","items":[{"sku":"x","qty":1,"priceCents":1}]}`, key); code != 422 ||
		body["error"].(map[string]any)["code"] != "idempotency_key_reused" {
		t.Fatalf("reused key: %d %v", code, body)
	}

	// A request still in flight elsewhere (its marker is set) makes a
	// duplicate a 409 with Retry-After, and another body with its key a 422.
	s.app.redis.Set(context.Background(), idempotencyKeyPrefix+"order-in-flight", fingerprintOf(t, validOrder)+" token-of-another", 0)
	inFlight := map[string]string{"Idempotency-Key": "order-in-flight"}
	if code, hdr, body := post(t, api+"/api/orders", validOrder, inFlight); code != 409 || hdr.Get("Retry-After") == "" {
		t.Fatalf("duplicate of an in-flight request: %d (Retry-After %q) %v", code, hdr.Get("Retry-After"), body)
	}
	if code, _, body := post(t, api+"/api/orders", `{"customer":"Bob","items":[{"sku":"x","qty":1,"priceCents":1}]}`, inFlight); code != 422 {
		t.Fatalf("another body with the key of an in-flight request: %d %v", code, body)
	}

	// Concurrent duplicates: one order; every answer is that order or a 409.
	var wg sync.WaitGroup
	codes := make([]int, 16)
	bodies := make([]map[string]any, 16)
	for i := range codes {
		wg.Go(func() {
			codes[i], _, bodies[i] = post(t, api+"/api/orders", validOrder, map[string]string{"Idempotency-Key": "order-race"})
		})
	}
	wg.Wait()
	var ids = map[any]bool{}
	for i, c := range codes {
		switch c {
		case 201:
			ids[bodies[i]["id"]] = true
		case 409:
		default:
			t.Errorf("concurrent duplicate answered %d %v", c, bodies[i])
		}
	}
	var n int
	s.app.db.QueryRow(context.Background(), `SELECT count(*) FROM orders WHERE idempotency_key = 'order-race'`).Scan(&n)
	if n != 1 || len(ids) != 1 {
		t.Fatalf("%d orders and %d distinct ids for one key", n, len(ids))
	}
}

// Without Redis the unique column alone keeps a retried POST from creating a
// second order, and the same key with another body is a 422 (issue 31: two
// concurrent POSTs answered 201 and 500).
func TestOrderIdempotencyWithoutRedis(t *testing.T) {
	env := fastEnv(t)
	s := startInProcess(t, env)
	opts, _ := redis.ParseURL(env["REDIS_URL"])
	api := apiURL(s)
	key := map[string]string{"Idempotency-Key": "no-redis"}
	_, _, first := post(t, api+"/api/orders", validOrder, key)
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	rdb.Shutdown(context.Background()) // Redis gone (the server refuses to come back in this test)
	code, _, again := post(t, api+"/api/orders", validOrder, key)
	if code != 201 || mustJSON(again) != mustJSON(first) {
		t.Fatalf("retry without Redis: %d %v", code, again)
	}

	other := `{"customer":"Bob","items":[{"sku":"x","qty":1,"priceCents":1}]}`
	for i := range 8 {
		key := map[string]string{"Idempotency-Key": fmt.Sprintf("no-redis-race-%d", i)}
		var codes [2]int
		var bodies [2]map[string]any
		var wg sync.WaitGroup
		for j, body := range []string{validOrder, other} {
			wg.Go(func() { codes[j], _, bodies[j] = post(t, api+"/api/orders", body, key) })
		}
		wg.Wait()
		if slices.Sort(codes[:]); codes != [2]int{201, 422} {
			t.Fatalf("one key, two bodies at once, without Redis: %v %v", codes, bodies)
		}
	}
}

// The marker is a lease: renewed while its request runs, released by
// compare-and-delete of its own value only, so a first request whose lease
// lapsed and was taken by a second request must not delete the second one's.
func TestIdempotencyMarkerIsALeaseOfItsHolder(t *testing.T) {
	t.Parallel()
	rdb := redisClient(t, testRedis(t).URL)
	ctx := context.Background()
	marker := idempotencyKeyPrefix + "lease-test"
	lease, _, err := claimMarker(ctx, rdb, marker, "hash-a", time.Second)
	if err != nil || lease == nil {
		t.Fatalf("claiming a free marker: %v %v", lease, err)
	}
	if _, holder, err := claimMarker(ctx, rdb, marker, "hash-b", time.Second); err != nil || holder != "hash-a" {
		t.Fatalf("claiming a held marker: holder %q, %v; want hash-a", holder, err)
	}
	// Renewed while held: alive after three lease times. Real time: Redis
	// expires the marker on its own clock.
	watch, stop := context.WithTimeout(ctx, 3*idempotencyLease)
	defer stop()
	pace(watch, idempotencyRenewEvery/2, func() bool {
		if n, err := rdb.Exists(ctx, marker).Result(); err != nil || n != 1 {
			t.Fatalf("the lease lapsed while its holder lives: exists=%d %v", n, err)
		}
		return true
	})
	if err := rdb.Set(ctx, marker, "hash-b token-of-second", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := lease.release(ctx); err != nil {
		t.Fatal(err)
	}
	if v, err := rdb.Get(ctx, marker).Result(); err != nil || v != "hash-b token-of-second" {
		t.Fatalf("another request's release removed the marker: %q %v", v, err)
	}
	rdb.Del(ctx, marker)
	lease, _, _ = claimMarker(ctx, rdb, marker, "hash-a", time.Second)
	if err := lease.release(ctx); err != nil {
		t.Fatal(err)
	}
	if n, err := rdb.Exists(ctx, marker).Result(); err != nil || n != 0 {
		t.Fatalf("the owner's release left the marker: exists=%d %v", n, err)
	}
}

// fingerprintOf is the fingerprint the handler computes for body.
func fingerprintOf(t *testing.T, body string) string {
	var o newOrder
	if err := json.Unmarshal([]byte(body), &o); err != nil {
		t.Fatal(err)
	}
	return o.fingerprint()
}

func mustJSON(v any) string {
	var b bytes.Buffer
	json.NewEncoder(&b).Encode(v)
	return b.String()
}

// GET /admin/orders?q= asks Meilisearch while it answers, and SQL when it does not.
func TestOrderSearchUsesMeilisearchThenFallsBackToSQL(t *testing.T) {
	meili := newMeiliDouble(t, "available")
	env := fastEnv(t, "MEILI_URL="+meili.srv.URL, "KUMIKO_ADMIN_TOKEN="+testAdminToken)
	s := startInProcess(t, env)
	api := apiURL(s)
	_, _, ada := post(t, api+"/api/orders", validOrder, nil)
	_, _, bob := post(t, api+"/api/orders", `{"customer":"Bob","items":[{"sku":"tea","qty":1,"priceCents":1}]}`, nil)
	bobID, _ := bob["id"].(string)

	meili.setHits(bobID, uuid.NewString()) // ranked by the index; the second is not (or no longer) in the database
	code, hdr, body := adminGet(t, opsURL(s), "/admin/orders?q=tea")
	orders, _ := body["orders"].([]any)
	if code != 200 || hdr.Get("X-Search-Source") != "meilisearch" || len(orders) != 1 || orders[0].(map[string]any)["id"] != bob["id"] {
		t.Fatalf("search with Meilisearch up: %d %s %v", code, hdr.Get("X-Search-Source"), body)
	}

	meili.srv.Close() // search goes down
	code, hdr, body = adminGet(t, opsURL(s), "/admin/orders?q=ad")
	orders, _ = body["orders"].([]any)
	if code != 200 || hdr.Get("X-Search-Source") != "sql" || len(orders) != 1 || orders[0].(map[string]any)["id"] != ada["id"] {
		t.Fatalf("search with Meilisearch down: %d %s %v", code, hdr.Get("X-Search-Source"), body)
	}
}

// Orders are known by an opaque public id. A row written before migration 13
// is backfilled and stays readable; new ids are UUIDv7, not a counter; the
// public order.created event carries no customer, no items and no order id,
// and migration 15 took the id out of the events written before it.
func TestOrderOpaqueIDsAndOldRows(t *testing.T) {
	env := fastEnv(t, "KUMIKO_ADMIN_TOKEN="+testAdminToken)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, env["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	mg, err := newMigrator(pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := mg.up(ctx); err != nil {
		t.Fatal(err)
	}
	if err := mg.down(ctx, 1); err != nil { // back to before migration 15: order events still carry the id
		t.Fatal(err)
	}
	mg.Close()
	if _, err := pool.Exec(ctx, `INSERT INTO orders (customer, items, total_cents) VALUES ('Old Ada', '[{"sku":"tea","qty":1,"priceCents":5}]', 5)`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
		SELECT 'order', id::text, 'order.created', jsonb_build_object('id', public_id, 'status', 'created', 'totalCents', 5, 'itemCount', 1)
		FROM orders`); err != nil {
		t.Fatal(err)
	}

	s := startInProcess(t, env) // auto-applies migration 15
	api := apiURL(s)
	code, _, list := adminGet(t, opsURL(s), "/admin/orders?q=old")
	orders, _ := list["orders"].([]any)
	if code != 200 || len(orders) != 1 {
		t.Fatalf("the old order after the migration: %d %v", code, list)
	}
	oldID, _ := orders[0].(map[string]any)["id"].(string)
	if _, err := uuid.Parse(oldID); err != nil {
		t.Fatalf("the old order's id %q is not a UUID", oldID)
	}
	if code, _, got := adminGet(t, opsURL(s), "/admin/orders/"+oldID); code != 200 || got["customer"] != "Old Ada" {
		t.Fatalf("GET the old order: %d %v", code, got)
	}

	var ids []uuid.UUID
	for range 2 {
		code, _, created := post(t, api+"/api/orders", validOrder, nil)
		id, err := uuid.Parse(fmt.Sprint(created["id"]))
		if code != 201 || err != nil || id.Version() != 7 {
			t.Fatalf("POST: %d %v (id: %v)", code, created, err)
		}
		ids = append(ids, id)
	}
	if ids[0] == ids[1] || ids[0].String()[24:] == ids[1].String()[24:] {
		t.Fatalf("consecutive ids share their random part: %s %s", ids[0], ids[1])
	}

	rows, err := pool.Query(ctx, `SELECT payload::text FROM outbox_events WHERE event_type = 'order.created'`)
	if err != nil {
		t.Fatal(err)
	}
	payloads, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(payloads) != 3 {
		t.Fatalf("order.created payloads: %v %v", payloads, err)
	}
	for _, p := range payloads {
		var ev map[string]any
		json.Unmarshal([]byte(p), &ev)
		if strings.Contains(p, "Ada") || strings.Contains(p, "tea") || ev["id"] != nil || strings.Contains(p, oldID) ||
			strings.Contains(p, ids[0].String()) || strings.Contains(p, ids[1].String()) || ev["status"] != "created" {
			t.Errorf("order.created payload %s: want totals, status and item count only", p)
		}
	}
}

// The order.created payload, written by SQL in the order's own statement,
// carries the order's createdAt exactly as the API answers it.
func TestOrderCreatedPayloadMatchesTheOrder(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	ctx := context.Background()
	for range 5 {
		code, _, created := post(t, apiURL(s)+"/api/orders", validOrder, nil)
		if code != 201 {
			t.Fatalf("POST = %d %v", code, created)
		}
		var payload string
		err := s.app.db.QueryRow(ctx, `SELECT e.payload::text FROM outbox_events e JOIN orders o ON e.aggregate_id = o.id::text
			WHERE e.aggregate_type = 'order' AND o.public_id = $1`, created["id"]).Scan(&payload)
		var ev orderCreated
		if err == nil {
			dec := json.NewDecoder(strings.NewReader(payload))
			dec.DisallowUnknownFields() // the payload is public: nothing beyond orderCreated
			err = dec.Decode(&ev)
		}
		if err != nil || ev.CreatedAt.Format(time.RFC3339Nano) != created["createdAt"] || ev.TotalCents != 900 ||
			ev.ItemCount != 2 || ev.Status != "created" {
			t.Fatalf("order %v: payload %s (%v)", created, payload, err)
		}
	}
}

// sqlJSONTime renders timestamps as encoding/json does, whatever their fraction.
func TestSQLJSONTimeMatchesEncodingJSON(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), fastEnv(t)["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for _, ts := range []string{"2026-01-02T03:04:05Z", "2026-01-02T03:04:05.5Z", "2026-12-31T23:59:59.123456Z",
		"2026-01-02T03:04:05.000001Z", "2026-01-02T03:04:05.10203Z", "1999-07-08T00:00:00.12Z"} {
		tm, _ := time.Parse(time.RFC3339Nano, ts)
		var got string
		if err := pool.QueryRow(context.Background(), `SELECT `+sqlJSONTime("($1::timestamptz AT TIME ZONE 'UTC')"), tm).Scan(&got); err != nil {
			t.Fatal(err)
		}
		want, _ := json.Marshal(tm)
		if `"`+got+`"` != string(want) {
			t.Errorf("%s: SQL renders %s, encoding/json %s", ts, got, want)
		}
	}
}

// FuzzDecodeOrder feeds arbitrary bodies to the order decoder. It must never
// panic, must answer every refusal with a 4xx, and what it accepts must be an
// order every rule holds for, which encodes and decodes back to itself.
// scripts/test.sh runs it for a few seconds on every test run.
func FuzzDecodeOrder(f *testing.F) {
	for _, seed := range []string{
		validOrder,
		`{"customer":"\ud800","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"customer":"Ada","customer":"Bob","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"CUSTOMER":"Ada","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"customer":"\u200b","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"customer":"A\u202eB","items":[{"sku":"t","qty":1,"priceCents":1}]}`,
		`{"customer":"Ada","items":[{"sku":"t","qty":1,"priceCents":1}]}{}`,
		`{"customer":"Ada","items":[[{"sku":{}}]]}`,
		`[]`, `"x"`, `{`, "",
	} {
		f.Add([]byte(seed))
	}
	e := echo.New()
	f.Fuzz(func(t *testing.T, body []byte) {
		req := httptest.NewRequest(http.MethodPost, "/api/orders", strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		o, err := decodeOrder(e.NewContext(req, httptest.NewRecorder()))
		if err != nil {
			he, ok := err.(*echo.HTTPError)
			if !ok || he.Code < 400 || he.Code > 499 {
				t.Fatalf("refused %q with %v, want a 4xx", body, err)
			}
			return
		}
		if problems := o.validate(); len(problems) > 0 {
			t.Fatalf("accepted %q breaking its rules: %v", body, problems)
		}
		for _, text := range append([]string{o.Customer}, skus(o)...) {
			if !utf8.ValidString(text) || textProblem(text) != "" || !visible(text) {
				t.Fatalf("accepted %q with the text %q", body, text)
			}
		}
		again, _ := json.Marshal(o)
		req = httptest.NewRequest(http.MethodPost, "/api/orders", strings.NewReader(string(again)))
		req.Header.Set("Content-Type", "application/json")
		o2, err := decodeOrder(e.NewContext(req, httptest.NewRecorder()))
		if err != nil || o2.fingerprint() != o.fingerprint() {
			t.Fatalf("accepted %q, but its own encoding %s decodes to %+v, %v", body, again, o2, err)
		}
	})
}

// FuzzOrderJSON: writeOrder's hand encoding is encoding/json's, byte for byte.
func FuzzOrderJSON(f *testing.F) {
	f.Add("Ada Lovelace", "tea", int64(2), int64(250), int64(1_780_000_000_123_456_000))
	f.Add(`<b>"Ada" & \co`, "caf\u00e9\u2028", int64(1), int64(0), int64(0))
	f.Add("\xff\x00", "ſku", int64(-1), int64(100_000_000), int64(-5))
	f.Fuzz(func(t *testing.T, customer, sku string, qty, price, unixNano int64) {
		o := order{PublicID: uuid.UUID{1, 2, 3}, Customer: customer, TotalCents: qty * price,
			Items:     []orderItem{{SKU: sku, Qty: qty, PriceCents: price}, {SKU: customer, Qty: price, PriceCents: qty}},
			CreatedAt: time.Unix(0, unixNano).UTC()}
		const token = "AbC-_09xyzAbC-_09xyzAbC-_09xyzAbC-_09xyzAbC" // what readToken makes: 43 URL-safe base64 characters
		var want bytes.Buffer
		if err := json.NewEncoder(&want).Encode(createdOrder{order: o, ReadToken: token}); err != nil {
			t.Skip(err) // a time encoding/json refuses; orders are stamped now
		}
		if got := appendOrderJSON(nil, o, token); !bytes.Equal(got, want.Bytes()) {
			t.Fatalf("appendOrderJSON: %s\nencoding/json:  %s", got, want.Bytes())
		}
	})
}

func skus(o newOrder) []string {
	var out []string
	for _, it := range o.Items {
		out = append(out, it.SKU)
	}
	return out
}

// The jobs an order triggers write to a real S3 server (versitygw): a receipt
// sealed with the master key; the index job reaches Meilisearch; a report
// run by hand lands in S3 too.
func TestJobsWriteToRealS3AndIndex(t *testing.T) {
	s3 := testS3(t)
	meili := newMeiliDouble(t, "available")
	s := startInProcess(t, fastEnv(t,
		"MEILI_URL="+meili.srv.URL,
		"S3_ENDPOINT="+s3.Endpoint, "S3_ACCESS_KEY="+s3.AccessKey, "S3_SECRET_KEY="+s3.SecretKey, "S3_BUCKET=kumiko",
		"KUMIKO_ADMIN_TOKEN="+testAdminToken,
		"KUMIKO_JOBS_POLL_INTERVAL=100ms",
	))
	_, _, created := post(t, apiURL(s)+"/api/orders", validOrder, nil)
	var id int64 // receipts are named by the internal id; the API shows only the public one
	if err := s.app.db.QueryRow(context.Background(), `SELECT id FROM orders WHERE public_id = $1`, created["id"]).Scan(&id); err != nil {
		t.Fatalf("order %v: %v", created["id"], err)
	}

	client, _ := minio.New(s3.Endpoint, &minio.Options{Creds: credentials.NewStaticV4(s3.AccessKey, s3.SecretKey, "")})
	name := "receipts/" + itoa(id) + "-" + itoa(id) + ".sealed" // the only order: a batch of one
	var sealed []byte
	waitFor(t, 10*time.Second, "the receipt in S3", func() bool {
		obj, err := client.GetObject(context.Background(), "kumiko", name, minio.GetObjectOptions{})
		if err != nil {
			return false
		}
		defer obj.Close()
		sealed, err = io.ReadAll(obj)
		return err == nil && len(sealed) > 0
	})
	plain, err := s.app.masterKey.open(sealed, []byte(name))
	if err != nil {
		t.Fatalf("the receipt does not open with the master key: %v", err)
	}
	var receipts []order
	if err := json.Unmarshal(plain, &receipts); err != nil || len(receipts) != 1 || receipts[0].PublicID.String() != created["id"] || receipts[0].TotalCents != 900 {
		t.Fatalf("receipts %s: %+v %v", plain, receipts, err)
	}
	if bytes.Contains(sealed, []byte("Ada")) {
		t.Fatal("the receipt is stored in the clear")
	}
	waitFor(t, 5*time.Second, "the order indexed", func() bool { return meili.called("POST /indexes/orders/documents") })

	runJob(t, "http://"+s.app.ops.addr.String(), "report", "")
	waitFor(t, 10*time.Second, "a report in S3", func() bool {
		for obj := range client.ListObjects(context.Background(), "kumiko", minio.ListObjectsOptions{Prefix: "reports/"}) {
			if obj.Err == nil {
				return true
			}
		}
		return false
	})
}

// A writeReceipt job writes its batch's receipts as one object, named by the
// first and last order, and a retry writes the same object again: one
// object, whatever the attempts.
func TestWriteReceiptWritesOneObjectPerBatchAndARetryReplacesIt(t *testing.T) {
	s3 := testS3(t)
	s := startInProcess(t, fastEnv(t))
	var ids []int64
	for _, cents := range []int64{300, 100, 200} {
		_, _, created := post(t, apiURL(s)+"/api/orders", `{"customer":"Ada","items":[{"sku":"tea","qty":1,"priceCents":`+itoa(cents)+`}]}`, nil)
		var id int64
		if err := s.app.db.QueryRow(context.Background(), `SELECT id FROM orders WHERE public_id = $1`, created["id"]).Scan(&id); err != nil {
			t.Fatalf("order %v: %v", created["id"], err)
		}
		ids = append(ids, id)
	}
	ctx := context.Background()
	client, _ := minio.New(s3.Endpoint, &minio.Options{Creds: credentials.NewStaticV4(s3.AccessKey, s3.SecretKey, "")})
	if err := client.MakeBucket(ctx, "batches", minio.MakeBucketOptions{}); err != nil {
		t.Fatalf("making the bucket: %v", err)
	}
	d := workDeps{call: 5 * time.Second, db: s.app.db, storage: client, bucket: "batches", masterKey: s.app.masterKey}
	job := &river.Job[writeReceiptArgs]{Args: writeReceiptArgs{OrderIDs: []int64{ids[2], ids[0], ids[1]}}}
	for attempt := 1; attempt <= 2; attempt++ {
		if err := writeReceipt(d, ctx, job); err != nil {
			t.Fatalf("attempt %d: %v", attempt, err)
		}
	}

	var names []string
	for obj := range client.ListObjects(ctx, "batches", minio.ListObjectsOptions{Recursive: true}) {
		if obj.Err != nil {
			t.Fatalf("listing: %v", obj.Err)
		}
		names = append(names, obj.Key)
	}
	name := "receipts/" + itoa(ids[0]) + "-" + itoa(ids[2]) + ".sealed"
	if !slices.Equal(names, []string{name}) {
		t.Fatalf("objects after two attempts: %v, want only %s", names, name)
	}
	obj, err := client.GetObject(ctx, "batches", name, minio.GetObjectOptions{})
	if err != nil {
		t.Fatalf("reading %s: %v", name, err)
	}
	defer obj.Close()
	sealed, err := io.ReadAll(obj)
	if err != nil {
		t.Fatalf("reading %s: %v", name, err)
	}
	plain, err := s.app.masterKey.open(sealed, []byte(name))
	if err != nil {
		t.Fatalf("%s does not open with the master key: %v", name, err)
	}
	var receipts []order
	if err := json.Unmarshal(plain, &receipts); err != nil {
		t.Fatalf("receipts %s: %v", plain, err)
	}
	var got []int64
	for _, r := range receipts {
		got = append(got, r.TotalCents)
	}
	if !slices.Equal(got, []int64{300, 100, 200}) {
		t.Fatalf("receipts' totals in id order: %v, want [300 100 200]", got)
	}
}

// kumiko_sse_send_lag_seconds times each write to a stream from the moment
// its oldest event was written: every event the stream received was written
// during this test, so every sample is shorter than the test so far.
func TestSSESendLagIsObserved(t *testing.T) {
	testStart := time.Now()
	s := startInProcess(t, fastEnv(t))
	stream := openSSE(t, apiURL(s), 0)
	if code, _, body := post(t, apiURL(s)+"/api/orders", `{"customer":"Ada","items":[{"sku":"tea","qty":1,"priceCents":250}]}`, nil); code != http.StatusCreated {
		t.Fatalf("POST /api/orders: %d %v", code, body)
	}
	var received int // the instance's own state change may come before the order
	stream.waitFor(10*time.Second, "order.created", func(frames []sseFrame) bool {
		received = len(frames)
		return slices.ContainsFunc(frames, func(f sseFrame) bool { return f.Event == "order.created" })
	})

	// A sample is taken once its write returned, which may be after the client read it.
	var m dto.Metric
	poll(5*time.Second, 5*time.Millisecond, func() bool {
		if err := s.app.blocks.sse.sendLag.Write(&m); err != nil {
			t.Fatal(err)
		}
		return m.GetHistogram().GetSampleCount() > 0
	})
	h := m.GetHistogram()
	if n := h.GetSampleCount(); n == 0 || n > uint64(received) {
		t.Fatalf("kumiko_sse_send_lag_seconds has %d samples for %d events received, want 1 to %d (one per write)", n, received, received)
	}
	if sum, most := h.GetSampleSum(), float64(h.GetSampleCount())*time.Since(testStart).Seconds(); sum <= 0 || sum > most {
		t.Errorf("send lags add up to %.6f s over %d writes, want in (0, %.6f]: each shorter than the test so far", sum, h.GetSampleCount(), most)
	}
}
