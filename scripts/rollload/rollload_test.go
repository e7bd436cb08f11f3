package main

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// t0 is the moment app1 is asked to stop in the logs below.
var t0 = time.Date(2026, 12, 4, 10, 0, 0, 0, time.UTC)

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

// logOf writes JSON log lines the way logrus does: each with its time.
func logOf(lines ...string) string {
	var b strings.Builder
	for _, l := range lines {
		b.WriteString(l + "\n")
	}
	return b.String()
}

func line(ms int, fields string) string {
	return fmt.Sprintf(`{"level":"info","msg":"lifecycle","component":"lifecycle","time":%q,%s}`, at(ms).Format(time.RFC3339Nano), fields)
}

// app1 drains from 0 ms to 700 ms, is down until its successor is ready at
// 2000 ms; the log also holds its boot before and the successor's boot.
var app1Log = logOf(
	line(-5000, `"event":"state_changed","from":"starting","to":"ready"`),
	`panic-free but not JSON: the runtime writes such lines`,
	line(0, `"event":"shutdown_requested","reason":"terminated"`),
	line(0, `"event":"state_changed","from":"ready","to":"draining"`),
	line(1, `"step":"readiness","duration_ms":0`),
	line(500, `"event":"linger_ended","ended":"quiet","duration_ms":499,"quiet_ms":250`),
	line(500, `"step":"linger","duration_ms":499`),
	line(510, `"step":"closeListener","duration_ms":10`),
	line(520, `"step":"sseClose","duration_ms":10`),
	line(600, `"step":"inFlight","duration_ms":80`),
	line(650, `"step":"jobsWorker","duration_ms":50`),
	line(690, `"step":"opsListener","duration_ms":40`),
	line(700, `"event":"exit","code":0,"duration_ms":700`),
	line(1500, `"phase":"config","duration_ms":1`), // the successor boots: no step of the drain
	line(2000, `"event":"state_changed","from":"starting","to":"ready"`),
)

func TestParseDrains(t *testing.T) {
	drains, err := parseDrains("app1", strings.NewReader(app1Log))
	if err != nil {
		t.Fatal(err)
	}
	if len(drains) != 1 {
		t.Fatalf("want 1 drain, got %d: %+v", len(drains), drains)
	}
	d := drains[0]
	if d.exitTook() != 700*time.Millisecond || d.linger != 499*time.Millisecond || d.lingerEnd != "quiet" || !d.readyAt.Equal(at(2000)) {
		t.Errorf("want exit after 700ms, linger 499ms ended quiet, ready again at 2000ms; got %+v", d)
	}
	var names []string
	for _, s := range d.spans() {
		names = append(names, s.name)
	}
	want := "readiness linger closeListener sseClose inFlight jobsWorker opsListener exit exited"
	if got := strings.Join(names, " "); got != want {
		t.Errorf("spans:\n got %s\nwant %s", got, want)
	}
}

// A failure belongs to the step of the instance that was draining when it
// came; a step's line is logged at its end, so a moment on a boundary
// belongs to the step that ends there.
func TestPlace(t *testing.T) {
	app1, err := parseDrains("app1", strings.NewReader(app1Log))
	if err != nil {
		t.Fatal(err)
	}
	// app2 is stopped once app1 is back: from 3000 ms, and its log ends in the drain.
	app2, err := parseDrains("app2", strings.NewReader(logOf(
		line(3000, `"event":"shutdown_requested","reason":"terminated"`),
		line(3000, `"step":"readiness","duration_ms":0`),
		line(6000, `"step":"linger","duration_ms":3000`),
	)))
	if err != nil {
		t.Fatal(err)
	}
	drains := append(app1, app2...)
	for _, c := range []struct {
		ms   int
		want placement
	}{
		{-1, placement{"", stepServing}},
		{0, placement{"app1", "readiness"}},
		{300, placement{"app1", "linger"}},
		{500, placement{"app1", "linger"}},
		{501, placement{"app1", "closeListener"}},
		{590, placement{"app1", "inFlight"}},
		{695, placement{"app1", stepExit}},
		{1000, placement{"app1", stepDown}},
		{2001, placement{"", stepServing}},
		{4000, placement{"app2", "linger"}},
		{9000, placement{"app2", stepExit}}, // the log ends inside the drain
	} {
		if got := place(drains, at(c.ms)); got != c.want {
			t.Errorf("failure at %d ms: got %+v, want %+v", c.ms, got, c.want)
		}
	}
}

func TestBreakdownCountsByStepAndConnection(t *testing.T) {
	drains, err := parseDrains("app1", strings.NewReader(app1Log))
	if err != nil {
		t.Fatal(err)
	}
	ok := func(ms int) result { return result{Start: at(ms - 5), End: at(ms), Status: 200, Conns: 1} }
	results := []result{
		ok(-100), ok(300), ok(505),
		{Start: at(505), End: at(506), Error: "connection reset by peer", Reused: true, Conns: 1},
		{Start: at(506), End: at(507), Status: 502, Reused: true, Conns: 2},
		{Start: at(800), End: at(800), Status: 503, Conns: 1, Body: "<html><body><h1>503 Service Unavailable</h1>\nNo server"},
		{Start: at(-200), End: at(-199), Status: 500, Conns: 1, Server: "app2", Body: `{"error":{"code":"internal"}}`},
		{Start: at(299), End: at(300), Status: 503, Conns: 1, Server: "app1", Body: `{"error":{"code":"draining"}}`},
	}
	var out strings.Builder
	failed := write(&out, []run{{name: "roll", results: results}}, drains)
	if failed != 5 {
		t.Errorf("want 5 failed, got %d", failed)
	}
	for _, want := range []string{
		"roll     requests      8  failed    5",
		"resent by net/http on a new connection 1",
		"app1     SIGTERM → exit   700 ms  (linger 499 ms, ended quiet)",
		//          step            new reused  draining other balancer nobody
		row("not draining", 1, 0, 0, 1, 0, 0),
		row("linger", 1, 0, 1, 0, 0, 0),
		row("closeListener", 0, 2, 0, 0, 1, 1),
		row("exited", 1, 0, 0, 0, 1, 0),
		row("total", 3, 2, 1, 1, 2, 1),
		"(app1 closeListener, reused connection, 1 conns tried, after 1ms): connection reset by peer",
		"(app1 exited, new connection, 1 conns tried, after 0s): status 503 from the load balancer: <html><body><h1>503 Service Unavailable</h1> No server",
		`(not draining, new connection, 1 conns tried, after 1ms): status 500 from app2: {"error":{"code":"internal"}}`,
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("want %q in the report:\n%s", want, out.String())
		}
	}
}

// row is a line of the table as the report prints it.
func row(step string, n ...int) string {
	return fmt.Sprintf("  %-16s %6d %6d   %8d %6d %8d %9d\n", step, n[0], n[1], n[2], n[3], n[4], n[5])
}

// With nothing failed the table is still there, one row of zeros a step:
// it says the drain lost nothing anywhere.
func TestBreakdownPrintsZeros(t *testing.T) {
	drains, err := parseDrains("app1", strings.NewReader(app1Log))
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	failed := write(&out, []run{{name: "steady"}, {name: "roll", results: []result{{Start: at(1), End: at(2), Status: 201}}}}, drains)
	if failed != 0 {
		t.Errorf("want 0 failed, got %d", failed)
	}
	for _, step := range []string{stepServing, "readiness", "linger", "closeListener", "sseClose", "inFlight", "jobsWorker", "opsListener", stepExit, stepDown, "total"} {
		if want := row(step, 0, 0, 0, 0, 0, 0); !strings.Contains(out.String(), want) {
			t.Errorf("want the row %q in the report:\n%s", want, out.String())
		}
	}
	if want := "steady   requests      0  failed    0  p50      - ms"; !strings.Contains(out.String(), want) {
		t.Errorf("want %q for a run without requests:\n%s", want, out.String())
	}
}

// send tells a new connection from a reused one: the first request to a
// server opens one, the next reuses it, and one after the server closed it
// opens another.
func TestSendTellsNewFromReused(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Has("close") {
			w.Header().Set("Connection", "close")
		}
		if r.URL.Query().Has("fail") {
			w.Header().Set("X-Served-By", "app1") // what HAProxy adds in scripts/lib/stack.sh
			http.Error(w, `{"error":{"code":"draining"}}`, http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{}}
	for i, c := range []struct {
		query  string
		reused bool
	}{{"", false}, {"", true}, {"?close", true}, {"", false}} {
		r := send(client, target{Method: http.MethodGet, URL: srv.URL + c.query})
		if r.failed() || r.Reused != c.reused || r.Conns != 1 || r.End.Before(r.Start) {
			t.Errorf("request %d: want status 200 on a %s connection, got %+v", i+1, conn(c.reused), r)
		}
	}
	if r := send(client, target{Method: http.MethodGet, URL: srv.URL + "?fail"}); r.Status != 503 || r.Server != "app1" || !strings.Contains(r.Body, `"draining"`) {
		t.Errorf("a failed answer: want its status, server and body kept, got %+v", r)
	}
	if r := send(client, target{Method: http.MethodGet, URL: "http://127.0.0.1:1/"}); !r.failed() || r.Reused || r.Error == "" {
		t.Errorf("a refused connection: want a failed request on a new connection with its error, got %+v", r)
	}
}
