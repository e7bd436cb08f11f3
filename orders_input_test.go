package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"
)

// Every input a client controls is validated or refused with a 4xx naming
// it (issue 20). "before" is what the service answered before the fix.
func TestEveryClientInputIsValidatedOrRefused(t *testing.T) {
	env := fastEnv(t, "KUMIKO_ADMIN_TOKEN="+testAdminToken)
	s := startInProcess(t, env)
	api, ops := apiURL(s), opsURL(s)
	order := func(customer, sku string) string {
		return `{"customer":"` + customer + `","items":[{"sku":"` + sku + `","qty":1,"priceCents":1}]}`
	}
	for _, tc := range []struct {
		name, method, url, body string
		header                  map[string]string
		before                  string
		status                  int
		code, mentions          string
	}{
		{"lone surrogate in customer", "POST", api + "/api/orders", order(`\ud800`, "tea"), nil, "201, stored U+FFFD", 422, "validation_failed", "customer: must not contain U+FFFD"},
		{"lone low surrogate in sku", "POST", api + "/api/orders", order("Ada", `t\udc00`), nil, "201, stored U+FFFD", 422, "validation_failed", "items[0].sku: must not contain U+FFFD"},
		{"duplicate key", "POST", api + "/api/orders", `{"customer":"Ada","customer":"Bob","items":[{"sku":"t","qty":1,"priceCents":1}]}`, nil, "201, the last one won", 400, "invalid_json", `duplicate field "customer"`},
		{"duplicate key in an item", "POST", api + "/api/orders", `{"customer":"Ada","items":[{"sku":"t","qty":1,"qty":9,"priceCents":1}]}`, nil, "201, the last one won", 400, "invalid_json", `duplicate field "qty"`},
		{"CUSTOMER", "POST", api + "/api/orders", `{"CUSTOMER":"Ada","items":[{"sku":"t","qty":1,"priceCents":1}]}`, nil, "201", 400, "invalid_json", `unknown field "CUSTOMER": field names are case-sensitive, this one is "customer"`},
		{"Customer next to customer", "POST", api + "/api/orders", `{"customer":"Ada","Customer":"Bob","items":[{"sku":"t","qty":1,"priceCents":1}]}`, nil, "201, Bob stored", 400, "invalid_json", `unknown field "Customer"`},
		{"long s in ſku", "POST", api + "/api/orders", `{"customer":"Ada","items":[{"ſku":"t","qty":1,"priceCents":1}]}`, nil, "201", 400, "invalid_json", `unknown field "\u017fku"`},
		{"only U+200B", "POST", api + "/api/orders", order(`\u200b`, "tea"), nil, "201", 422, "validation_failed", "customer: must not contain the invisible format character U+200B"},
		{"bidi override U+202E", "POST", api + "/api/orders", order("Ada\u202egpj.exe", "tea"), nil, "201", 422, "validation_failed", "customer: must not contain the bidi control U+202E"},
		{"bidi isolate in sku", "POST", api + "/api/orders", order("Ada", `t\u2066x`), nil, "201", 422, "validation_failed", "items[0].sku: must not contain the bidi control U+2066"},
		{"byte order mark", "POST", api + "/api/orders", order(`\ufeffAda`, "tea"), nil, "201", 422, "validation_failed", "U+FEFF"},
		{"only a joiner", "POST", api + "/api/orders", order(`\u200c`, "tea"), nil, "201", 422, "validation_failed", "customer: must show at least one visible character"},
		{"Persian name with ZWNJ", "POST", api + "/api/orders", order("می\u200cخواهم", "tea"), nil, "201", 201, "", ""},
		{"emoji with ZWJ", "POST", api + "/api/orders", order("Ada 👩\u200d💻", "tea"), nil, "201", 201, "", ""},
		{"q=%ff", "GET", ops + "/admin/orders?q=%ff", "", map[string]string{"Authorization": "Bearer " + testAdminToken}, "500, error log (SQLSTATE 22021)", 400, "invalid_query", "q: must be valid UTF-8"},
		{"q=%00", "GET", ops + "/admin/orders?q=%00", "", map[string]string{"Authorization": "Bearer " + testAdminToken}, "500, error log (SQLSTATE 22021)", 400, "invalid_query", "q: must not contain control characters"},
		{"q=%zz", "GET", ops + "/admin/orders?q=%zz", "", map[string]string{"Authorization": "Bearer " + testAdminToken}, "200, q dropped: every order listed", 400, "invalid_query", "not valid URL encoding"},
		{"q twice", "GET", ops + "/admin/orders?q=a&q=b", "", map[string]string{"Authorization": "Bearer " + testAdminToken}, "200, the first q", 400, "invalid_query", "q: give it once"},
		{"public search", "GET", api + "/api/orders?q=ad", "", nil, "200 with names and items", 405, "method_not_allowed", ""},
		{"admin q=%ff", "GET", ops + "/admin/orders?q=%ff", "", map[string]string{"Authorization": "Bearer " + testAdminToken}, "(new route)", 400, "invalid_query", "q: must be valid UTF-8"},
		{"admin q=U+202E", "GET", ops + "/admin/orders?q=%E2%80%AE", "", map[string]string{"Authorization": "Bearer " + testAdminToken}, "(new route)", 400, "invalid_query", "U+202E"},
		{"Last-Event-ID: -1", "GET", api + "/api/events", "", map[string]string{"Last-Event-ID": "-1"}, "400", 400, "invalid_last_event_id", "Last-Event-ID"},
		{"Last-Event-ID: +5", "GET", api + "/api/events", "", map[string]string{"Last-Event-ID": "+5"}, "400 (unknown event 5)", 400, "invalid_last_event_id", "Last-Event-ID"},
		{"Last-Event-ID too large", "GET", api + "/api/events", "", map[string]string{"Last-Event-ID": "99999999999999999999"}, "400", 400, "invalid_last_event_id", "Last-Event-ID"},
		{"lastEventId=%ff", "GET", api + "/api/events?lastEventId=%ff", "", nil, "400", 400, "invalid_last_event_id", "Last-Event-ID"},
		{"lastEventId=%zz", "GET", api + "/api/events?lastEventId=%zz", "", nil, "200, dropped: a live stream", 400, "invalid_query", "not valid URL encoding"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, _ := http.NewRequest(tc.method, tc.url, strings.NewReader(tc.body))
			if tc.body != "" {
				req.Header.Set("Content-Type", "application/json")
			}
			for k, v := range tc.header {
				req.Header.Set(k, v)
			}
			resp, raw := roundTrip(t, nil, req)
			var body struct{ Error errorBody }
			_ = json.Unmarshal(raw, &body)
			t.Logf("%s → before: %s; now: %d %s", tc.name, tc.before, resp.StatusCode, strings.TrimSpace(string(raw)))
			if resp.StatusCode != tc.status || body.Error.Code != tc.code || !strings.Contains(body.Error.Message, tc.mentions) {
				t.Errorf("%s %s = %d %s; want %d %s mentioning %q", tc.method, tc.url, resp.StatusCode, raw, tc.status, tc.code, tc.mentions)
			}
		})
	}
	// Only the two orders meant to be accepted were written.
	if n := countRows(t, s, "orders"); n != 2 {
		t.Errorf("%d orders written, want the 2 valid ones", n)
	}

	// Last-Event-ID: 0 replays from the beginning (it was refused with a 400).
	first := openSSEHeader(t, http.DefaultClient, api, "0")
	if first.status != 200 {
		t.Fatalf("Last-Event-ID: 0 = %d %s", first.status, first.body)
	}
	first.waitFor(10*time.Second, "both orders' events replayed", func(f []sseFrame) bool {
		n := 0
		for _, frame := range f {
			if frame.Event == "order.created" {
				n++
			}
		}
		return n == 2
	})
}

// FuzzKeyProblem: the byte walk that keyProblem takes for valid JSON names
// the same first problem as the token walk it replaces on the request path.
func FuzzKeyProblem(f *testing.F) {
	for _, seed := range []string{
		`{"title":"Ada","parts":[{"size":"t","count":1,"weightGrams":1}]}`,
		`{"title":"Ada","title":"Bob"}`, `{"parts":[{"count":1,"count":9}]}`, `{"TITLE":1}`, `{"ſize":1}`,
		`{"tit\u006ce":1,"title":2}`, `{"a":"title","title":"\"title\"","title":3}`,
		`[{"size":1},{"size":2}]`, `{"x":{"size":1},"size":2,"y":[{"size":3,"SIZE":4}]}`, `"title"`, `{}`, `[]`,
		`{"title":"Ada","title":1} trailing`, `{"title":1,`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		if !json.Valid(raw) {
			return // keyProblem takes the token walk itself
		}
		names := []string{"title", "parts", "size", "count", "weightGrams"}
		if got, want := scanKeys(raw, names), keyProblemByTokens(raw, names); got != want {
			t.Fatalf("%q: byte walk %q, token walk %q", raw, got, want)
		}
	})
}
