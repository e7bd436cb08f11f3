package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
)

// syncBuffer collects the log lines of an in-process service.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// lines decodes the JSON log lines written so far.
func (b *syncBuffer) lines() []map[string]any {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(b.buf.Bytes()))
	for sc.Scan() {
		l := map[string]any{}
		if json.Unmarshal(sc.Bytes(), &l) == nil {
			out = append(out, l)
		}
	}
	return out
}

func (b *syncBuffer) find(want map[string]any) map[string]any {
	for _, l := range b.lines() {
		if matches(l, want) {
			return l
		}
	}
	return nil
}

// inProcess is the service running inside the test, through newApp and serve.
type inProcess struct {
	app    *app
	logs   *syncBuffer
	cancel context.CancelFunc
	done   chan error
}

func startInProcess(t testing.TB, env map[string]string) *inProcess {
	t.Helper()
	logs := &syncBuffer{}
	env["KUMIKO_CONFIG"] = ""
	t.Chdir(t.TempDir()) // no kumiko.config.yaml here
	a := newApp(func(k string) string { return env[k] }, environOf(env), logs)
	ctx, cancel := context.WithCancel(context.Background())
	s := &inProcess{app: a, logs: logs, cancel: cancel, done: make(chan error, 1)}
	// Every goroutine the service starts, directly or through a library,
	// inherits this label: after the drain none may be left.
	label := pprof.Labels(appLabel, fmt.Sprintf("%s#%d", t.Name(), inProcessStarts.Add(1)))
	go pprof.Do(ctx, label, func(ctx context.Context) { s.done <- a.serve(ctx) })
	t.Cleanup(func() {
		cancel()
		select {
		case <-s.done:
			checkNoGoroutineLeft(t, label)
		case <-time.After(15 * time.Second):
			t.Error("in-process service did not stop")
		}
	})
	poll(20*time.Second, 5*time.Millisecond, func() bool { return a.lc.State() != StateStarting })
	if a.lc.State() != StateReady {
		t.Fatalf("service state %s, logs:\n%s", a.lc.State(), logs.String())
	}
	return s
}

// appLabel is the pprof label that marks the goroutines of one in-process
// service; inProcessStarts numbers the services a test binary starts.
const appLabel = "kumikoApp"

var inProcessStarts atomic.Int64

// checkNoGoroutineLeft fails t when a goroutine of the service labelled
// label outlives its drain, and prints each one's stack. A goroutine may
// take a moment to return after the drain ended (an abandoned call's
// grace), so it waits up to 5 s for them to go.
func checkNoGoroutineLeft(t testing.TB, label pprof.LabelSet) {
	t.Helper()
	var want string
	pprof.ForLabels(pprof.WithLabels(context.Background(), label), func(k, v string) bool {
		want = fmt.Sprintf("%q:%q", k, v)
		return false
	})
	var left []string
	// Polling the runtime: no event says a goroutine returned.
	if !poll(5*time.Second, 20*time.Millisecond, func() bool {
		left = left[:0]
		var buf bytes.Buffer
		pprof.Lookup("goroutine").WriteTo(&buf, 1)
		for group := range strings.SplitSeq(buf.String(), "\n\n") {
			// os/signal's one loop per process takes the labels of
			// whoever called signal.Notify first, and lives on by design.
			if strings.Contains(group, want) && !strings.Contains(group, "os/signal.loop") {
				left = append(left, group)
			}
		}
		return len(left) == 0
	}) {
		t.Errorf("goroutines of the service left after its drain:\n%s", strings.Join(left, "\n\n"))
	}
}

// stop asks for a shutdown the way SIGTERM does and returns serve's error.
func (s *inProcess) stop(t *testing.T) error {
	t.Helper()
	s.cancel()
	select {
	case err := <-s.done:
		s.done <- err // for the cleanup
		return err
	case <-time.After(15 * time.Second):
		t.Fatal("service did not stop")
		return nil
	}
}

// A panic in a background goroutine is logged with its stack, counted, and
// starts a graceful shutdown that ends in exit 1. The goroutine is started the
// way every background component starts its own: through startStop, with the
// app's panicked as onPanic; it says it is a heartbeat loop.
func TestBackgroundPanicDrainsAndFails(t *testing.T) {
	s := startInProcess(t, fastEnv(t))
	w := newStartStop(componentJobsHeartbeat, stopNow, s.app.panicked)
	t.Cleanup(func() { w.Stop(context.Background()) })
	if err := w.start(context.Background(), nil, func(context.Context) { panic("worker state corrupted") }); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-s.done:
		s.done <- err
		if err == nil || !strings.Contains(err.Error(), "panic in jobsHeartbeat") {
			t.Fatalf("serve returned %v, want a failure naming the panic", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a background panic did not shut the service down")
	}
	l := s.logs.find(map[string]any{"msg": "background goroutine panicked", "component": "jobsHeartbeat"})
	if l == nil || !strings.Contains(l["stack"].(string), "TestBackgroundPanicDrainsAndFails") {
		t.Fatalf("panic log line without stack: %v", l)
	}
	if s.logs.find(map[string]any{"event": "state_changed", "to": "stopped"}) == nil {
		t.Fatal("the panic did not lead to a full drain")
	}
}

// A panic in an HTTP handler is a 500 for that request only.
func TestHandlerPanicIsA500(t *testing.T) {
	e := newEcho(newLogger(&syncBuffer{}, "json"), newMetrics(), componentAPI)
	e.GET("/api/boom", func(c echo.Context) error { panic("handler bug") })
	rec := httptest.NewRecorder()
	e.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/api/boom", nil))
	if rec.Code != 500 || !strings.Contains(rec.Body.String(), `"code":"internal"`) {
		t.Fatalf("panic answered %d %s", rec.Code, rec.Body.String())
	}
}

// A shutdown hook that hangs past KUMIKO_SHUTDOWN_TIMEOUT makes the exit 1,
// and the process does not wait for it beyond the budget.
func TestHangingHookPastShutdownBudgetFails(t *testing.T) {
	env := fastEnv(t, "KUMIKO_LINGER=0", "KUMIKO_DRAIN_TIMEOUT=100ms")
	// The hung hook gets the budget minus a reserve for each hook after it
	// (hookDeadline); with about ten of them, 2 s leaves each some 80 ms,
	// enough on a busy core. (500 ms left 15 ms each: under load the last
	// hooks ran past the budget, and the error named the budget, not the hook.)
	budget := 2 * time.Second
	env["KUMIKO_SHUTDOWN_TIMEOUT"] = budget.String()
	s := startInProcess(t, env)
	hang := make(chan struct{})
	defer close(hang)
	// fastEnv configures no Meilisearch, so this is the only search hook: a
	// client whose close hangs.
	s.app.lc.RegisterShutdownHook(componentSearch, func(context.Context) error { <-hang; return nil })

	start := time.Now()
	err := s.stop(t)
	if err == nil || !strings.Contains(err.Error(), "shutdown hook search") {
		t.Fatalf("serve returned %v, want a failure naming the hung hook; the log:\n%s", err, s.logs)
	}
	if took := time.Since(start); took > budget+time.Second {
		t.Fatalf("shutdown took %s with a %s budget", took, budget)
	}
	// The hooks after the hung one still ran: the DB pool was closed.
	if s.logs.find(map[string]any{"step": "db"}) == nil {
		t.Fatal("the db hook did not run after the hung hook")
	}
}

// meiliDouble is a test double of the Meilisearch endpoints this project
// calls: GET /health, POST /indexes, PUT /indexes/{uid}/settings/searchable-attributes,
// POST /indexes/{uid}/documents and POST /indexes/{uid}/search (answering
// with the ids set in hits), for any index. No Meilisearch server can be
// installed here; docker-compose runs the real one.
type meiliDouble struct {
	srv *httptest.Server

	mu    sync.Mutex
	hits  []string
	calls []string
}

func newMeiliDouble(t testing.TB, status string) *meiliDouble {
	d := &meiliDouble{}
	d.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d.mu.Lock()
		d.calls = append(d.calls, r.Method+" "+r.URL.Path)
		hits := d.hits
		d.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		// "/indexes/{uid}/rest" → uid, "/rest"
		uid, rest, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/indexes/"), "/")
		rest = "/" + rest
		task := `{"taskUid":1,"indexUid":"` + uid + `","status":"enqueued","type":"indexCreation","enqueuedAt":"2026-01-01T00:00:00Z"}`
		index := strings.HasPrefix(r.URL.Path, "/indexes/") && uid != ""
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/health":
			w.Write([]byte(`{"status":"` + status + `"}`))
		case r.Method == http.MethodPost && r.URL.Path == "/indexes",
			index && r.Method == http.MethodPut && rest == "/settings/searchable-attributes",
			index && r.Method == http.MethodPost && rest == "/documents":
			w.WriteHeader(http.StatusAccepted)
			w.Write([]byte(task))
		case index && r.Method == http.MethodPost && rest == "/search":
			var out []map[string]string
			for _, id := range hits {
				out = append(out, map[string]string{"id": id})
			}
			json.NewEncoder(w).Encode(map[string]any{"hits": out, "query": "", "processingTimeMs": 1})
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(d.srv.Close)
	return d
}

func (d *meiliDouble) setHits(ids ...string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hits = ids
}

func (d *meiliDouble) called(call string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Contains(d.calls, call)
}

func apiURL(s *inProcess) string { return "http://" + s.app.api.addr.String() }

func opsURL(s *inProcess) string { return "http://" + s.app.ops.addr.String() }
