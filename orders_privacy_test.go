package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// A stranger on the public port, with no credentials, learns nothing about
// another customer: it replays the whole event stream, then calls every
// public GET route with every id-like value the stream carried — in the
// path, as a query value and as a bearer token. No customer name, no item,
// no order id and no read token appears anywhere, and no order is answered.
// The stream still shows that the orders flowed.
func TestStrangerLearnsNothingAboutAnotherCustomer(t *testing.T) {
	env := fastEnv(t, "KUMIKO_ADMIN_TOKEN="+testAdminToken)
	s := startInProcess(t, env)
	api := apiURL(s)

	// The customers' secrets: what a stranger must never see.
	var secrets []string
	const orders = 3
	for i := range orders {
		customer, sku := fmt.Sprintf("Ada Private%d", i), fmt.Sprintf("sku-private-%d", i)
		code, _, created := post(t, api+"/api/orders", fmt.Sprintf(`{"customer":%q,"items":[{"sku":%q,"qty":1,"priceCents":%d}]}`, customer, sku, 101+i), nil)
		if code != 201 {
			t.Fatalf("POST = %d %v", code, created)
		}
		secrets = append(secrets, customer, sku, fmt.Sprint(created["id"]), fmt.Sprint(created["readToken"]))
	}

	stream := replayWholeStream(t, api, orders)
	for _, secret := range secrets {
		if strings.Contains(stream, secret) {
			t.Errorf("the public event stream carries %q:\n%s", secret, stream)
		}
	}
	values := idLikeValues(t, stream)
	t.Logf("the stream: %d order.created events, %d id-like values: %v", strings.Count(stream, "event: order.created\n"), len(values), values)

	// Every public GET route, each path parameter filled with each value.
	calls := 0
	for _, f := range s.app.features {
		for _, r := range f.routes {
			if r.admin || r.method != http.MethodGet || r.streaming || r.path == "/api/slow" {
				continue // admin: the ops port; the stream: replayed above; /api/slow only sleeps
			}
			for _, v := range values {
				target := api + fillParams(r.path, v) + "?" + url.Values{"id": {v}, "q": {v}, "token": {v}}.Encode()
				for _, auth := range []string{"", "Bearer " + v} {
					code, body := strangerGet(t, target, auth)
					calls++
					if strings.HasPrefix(r.path, "/api/orders/") && code == http.StatusOK {
						t.Errorf("GET %s (Authorization %q) = 200: an order answered to a stranger: %s", target, auth, body)
					}
					for _, secret := range secrets {
						if strings.Contains(body, secret) {
							t.Errorf("GET %s (Authorization %q) = %d answers %q: %s", target, auth, code, secret, body)
						}
					}
				}
			}
		}
	}
	if calls == 0 {
		t.Fatal("no public route was called")
	}
	t.Logf("%d calls as a stranger, none told anything", calls)
}

// replayWholeStream reads GET /api/events from Last-Event-ID 0 until it has
// seen want order.created events, and returns the stream's text.
func replayWholeStream(t *testing.T, api string, want int) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, api+"/api/events", nil)
	req.Header.Set("Last-Event-ID", "0")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("opening the stream: %v", err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	sc := bufio.NewScanner(resp.Body)
	seen := 0
	for seen < want && sc.Scan() {
		b.WriteString(sc.Text() + "\n")
		if sc.Text() == "event: order.created" {
			seen++
		}
	}
	if seen < want {
		t.Fatalf("the replay showed %d of %d order.created events (%v); it said:\n%s", seen, want, sc.Err(), b.String())
	}
	// The rest of the last frame: its data line.
	for sc.Scan() && sc.Text() != "" {
		b.WriteString(sc.Text() + "\n")
	}
	return b.String()
}

// idLikeValues is every value in a stream's text a stranger could try as an
// id: each frame's id and every string and number in its JSON data.
func idLikeValues(t *testing.T, stream string) []string {
	t.Helper()
	var values []string
	var walk func(any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			for _, e := range v {
				walk(e)
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		case string:
			values = append(values, v)
		case float64:
			values = append(values, strconv.FormatFloat(v, 'f', -1, 64))
		}
	}
	for line := range strings.Lines(stream) {
		field, value, _ := strings.Cut(strings.TrimSuffix(line, "\n"), ": ")
		switch field {
		case "id":
			values = append(values, value)
		case "data":
			var data any
			if err := json.Unmarshal([]byte(value), &data); err != nil {
				t.Fatalf("a data line that is not JSON: %q", value)
			}
			walk(data)
		}
	}
	slices.Sort(values)
	return slices.Compact(values)
}

// fillParams puts v in place of every :param of an echo route path.
func fillParams(path, v string) string {
	return regexp.MustCompile(`:[^/]+`).ReplaceAllLiteralString(path, url.PathEscape(v))
}

func strangerGet(t *testing.T, target, auth string) (int, string) {
	t.Helper()
	resp, body := getBody(t, target, auth)
	return resp.StatusCode, string(body)
}
