package main

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	rtrace "runtime/trace"
	"strings"
	"testing"
	"time"

	"github.com/labstack/echo/v4"
)

// A release hook that hangs overruns its share: the drain leaves a trace
// with the hook's region, a dump taken while it still hung that shows its
// goroutine labelled step=<hook> where it hangs, and a termination message.
func TestDiagnosticsOfAHungReleaseHook(t *testing.T) {
	env := fastEnv(t, "KUMIKO_FLIGHT_RECORDER=true", "KUMIKO_LINGER=0", "KUMIKO_DRAIN_TIMEOUT=100ms", "KUMIKO_SHUTDOWN_TIMEOUT=2s")
	s := startInProcess(t, env)
	if !s.app.diag.recording() {
		t.Fatal("the flight recorder does not run")
	}
	hang := make(chan struct{})
	defer close(hang)
	s.app.lc.RegisterShutdownHook(componentSearch, func(context.Context) error { <-hang; return nil })
	if err := s.stop(t); err == nil {
		t.Fatal("a hung hook made no failure")
	}
	exit := s.logs.find(map[string]any{"event": "exit"})
	reason := firstReason(exit)
	t.Logf("exit line: %s", reason)
	if !strings.HasPrefix(reason, "search: release hook failed") || !strings.Contains(reason, "TestDiagnosticsOfAHungReleaseHook.func1 (diagnostics_test.go:") {
		t.Errorf("the exit line's reason %q does not name the hook and where it hung", reason)
	}
	if trace := parseTrace(t, exit["trace"].(string)); !strings.Contains(trace, `Type="step search"`) {
		t.Errorf("the trace has no region of the hook")
	}
	dump := string(must(os.ReadFile(exit["goroutines"].(string))))
	if len(stuckWith(dump, `"step":"search"`, "TestDiagnosticsOfAHungReleaseHook")) == 0 {
		t.Errorf("no goroutine labelled step=search where the hook hangs:\n%s", dump)
	}
	if msg := string(must(os.ReadFile(env["KUMIKO_TERMINATION_LOG"]))); !strings.Contains(msg, "exited 1") || !strings.Contains(msg, "search: release hook failed") {
		t.Errorf("termination message: %s", msg)
	}
}

// A boot phase that times out leaves the diagnostics of where it was stuck.
func TestDiagnosticsOfAPhaseTimeout(t *testing.T) {
	t.Parallel()
	tp := testToxiproxy(t)
	pg := testPostgres(t)
	proxy := proxyTo(t, tp, "postgres", hostOf(t, pg))
	blackHole(t, proxy)
	env := fastEnv(t, "KUMIKO_FLIGHT_RECORDER=true", "DATABASE_URL="+withHost(t, pg, proxy.Listen), "KUMIKO_CONNECT_MAX_WAIT=1500ms")
	p := startProc(t, env)
	if code := p.wait(20 * time.Second); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}
	d := readDiagnosed(t, p, env)
	reason := firstReason(d.exit)
	t.Logf("exit line: %s", reason)
	if !strings.Contains(reason, "dbConnect") || !strings.Contains(reason, "phase timeout") {
		t.Errorf("the reason %q does not name the phase that timed out", reason)
	}
	if !strings.Contains(d.trace, `Type="phase dbConnect"`) {
		t.Errorf("the trace has no region of the phase")
	}
	if len(stuckWith(d.goroutines, `"component":"db"`, "pgx"))+len(stuckWith(d.goroutines, `"phase":"dbConnect"`, "pgx")) == 0 {
		t.Errorf("no goroutine of the phase stuck in the connect:\n%s", d.goroutines)
	}
}

// hostOf is the host:port of a URL.
func hostOf(t testing.TB, rawURL string) string {
	t.Helper()
	rest := rawURL[strings.Index(rawURL, "@")+1:]
	host, _, _ := strings.Cut(rest, "/")
	return host
}

// A goroutine labelled where it waits is found by its label, with the
// frame it waits in.
func TestGoroutineDumpNamesWhereALabelledGoroutineIsBlocked(t *testing.T) {
	release := make(chan struct{})
	started := make(chan struct{})
	go labelled(context.Background(), labelStep, "testStep", func() {
		close(started)
		waitForRelease(release)
	})
	<-started
	defer close(release)
	var dump goroutineDump
	poll(5*time.Second, 10*time.Millisecond, func() bool {
		dump = takeGoroutines()
		return strings.Contains(dump.blocked(labelStep, "testStep"), "waitForRelease")
	})
	got := dump.blocked(labelStep, "testStep")
	if !strings.HasPrefix(got, "blocked in "+ownPackage()+"waitForRelease (diagnostics_test.go:") {
		t.Errorf("blocked = %q", got)
	}
	if all := dump.blocked(labelStep, ""); !strings.HasPrefix(all, "testStep, blocked in") {
		t.Errorf("blocked without a value = %q", all)
	}
	if none := dump.blocked(labelStep, "noSuchStep"); none != "" {
		t.Errorf("a label no goroutine has: %q", none)
	}
}

//go:noinline
func waitForRelease(c chan struct{}) { <-c }

// watchGoroutines keeps a look from while the step still ran, and none when
// the step was quick.
func TestWatchGoroutinesKeepsTheLastLook(t *testing.T) {
	stop := watchGoroutines(context.Background())
	if look := stop(); !look.at.IsZero() {
		t.Errorf("a quick step was looked at (%s)", look.at)
	}
	release := make(chan struct{})
	go labelled(context.Background(), labelStep, "slowStep", func() { waitForRelease(release) })
	stop = watchGoroutines(context.Background())
	time.Sleep(3 * stallFirstLook) // real time: the watch looks on its own clock
	look := stop()
	close(release)
	if look.at.IsZero() || !strings.Contains(look.blocked(labelStep, "slowStep"), "waitForRelease") {
		t.Errorf("the last look does not show the slow step: %q", look.blocked(labelStep, "slowStep"))
	}
}

// parseLabels reads the form a dump prints labels in.
func TestParseLabels(t *testing.T) {
	got := parseLabels(`{"component":"api", "route":"GET /api/items/:id", "x":"a \"q\""}`)
	want := map[string]string{"component": "api", "route": "GET /api/items/:id", "x": `a "q"`}
	if len(got) != len(want) {
		t.Fatalf("parseLabels = %v", got)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s = %q, want %q", k, got[k], v)
		}
	}
}

// The termination message says when and why, lists every incident with its
// files, and fits in what the kubelet reads.
func TestTerminationMessage(t *testing.T) {
	at := time.Date(2026, 12, 7, 13, 5, 41, 0, time.UTC)
	msg := terminationMessage("pod-1", at, 1, "terminated", errors.New("shutdown did not finish\nwithin 40s"), []incident{
		{reason: "inFlight: 1 request force-closed", trace: "/d/a.trace", goroutines: "/d/a.goroutines.txt"},
		{reason: "db: release hook failed"},
	})
	for _, want := range []string{serviceName + " pod-1 exited 1 at 2026-12-07T13:05:41Z (stop: terminated): shutdown did not finish; within 40s.",
		"1) inFlight: 1 request force-closed. Files: /d/a.trace, /d/a.goroutines.txt.", "2) db: release hook failed.", "/admin/diagnostics"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the message lacks %q:\n%s", want, msg)
		}
	}
	long := terminationMessage("pod-1", at, 1, "", errors.New(strings.Repeat("é", 5000)), nil)
	if len(long) > maxTerminationMessage || !strings.HasSuffix(long, "…") {
		t.Errorf("a long message is %d bytes, ends %q", len(long), long[len(long)-10:])
	}
}

// The directory keeps the newest files only, and lists only its own.
func TestDiagnosticsDirectoryIsBounded(t *testing.T) {
	dir := t.TempDir()
	d := &diagnostics{dir: dir, instance: "x/y", log: componentDiagnostics.log(newLogger(&syncBuffer{}, "json"))}
	os.WriteFile(filepath.Join(dir, "unrelated.txt"), nil, 0o600)
	for range keepDiagnosticFiles + 4 {
		if _, _, err := d.snapshot(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond) // real time: file names are stamped to the millisecond
	}
	files, err := d.files()
	if err != nil || len(files) != keepDiagnosticFiles {
		t.Fatalf("%d files (%v), want %d", len(files), err, keepDiagnosticFiles)
	}
	if strings.Contains(files[0].Name, "/") || !strings.Contains(files[0].Name, "-x_y-snapshot") {
		t.Errorf("file name %q", files[0].Name)
	}
	if _, err := os.Stat(filepath.Join(dir, "unrelated.txt")); err != nil {
		t.Errorf("a file not of the diagnostics was removed: %v", err)
	}
}

// BenchmarkLabelRequests is the per-request part of the recorder's cost
// alone: the route's pprof label and trace region around a handler that
// does nothing, without them, with them, and with them while a flight
// recorder runs (its regions are then written).
//
//	go test -run '^$' -bench LabelRequests .
func BenchmarkLabelRequests(b *testing.B) {
	for _, mode := range []string{"off", "labels", "labels+recorder"} {
		b.Run(mode, func(b *testing.B) {
			e := echo.New()
			h := func(c echo.Context) error { return c.NoContent(http.StatusNoContent) }
			var mw []echo.MiddlewareFunc
			if mode != "off" {
				mw = append(mw, labelRequests())
			}
			e.GET("/api/items/:id", h, mw...)
			if mode == "labels+recorder" {
				fr := rtrace.NewFlightRecorder(rtrace.FlightRecorderConfig{})
				if err := fr.Start(); err != nil {
					b.Skip("another flight recorder runs in this process:", err)
				}
				defer fr.Stop()
			}
			req := httptest.NewRequest(http.MethodGet, "/api/items/1", nil)
			b.ReportAllocs()
			for b.Loop() {
				e.ServeHTTP(httptest.NewRecorder(), req)
			}
		})
	}
}
