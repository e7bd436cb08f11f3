package main

// A drain that goes wrong explains itself (diagnostics.go): the flight
// recorder's trace, a labelled goroutine dump and a termination message,
// named in the exit line. A clean drain leaves nothing.

import (
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// diagnosed is what a drain left behind, read back.
type diagnosed struct {
	exit        map[string]any // the exit line
	trace       string         // the first incident's trace, parsed (go tool trace -d=parsed)
	goroutines  string         // the first incident's goroutine dump
	termination string         // the termination message
}

// readDiagnosed reads the files the exit line names and checks that the
// trace parses.
func readDiagnosed(t *testing.T, p *proc, env map[string]string) diagnosed {
	t.Helper()
	d := diagnosed{exit: p.waitLog(time.Second, map[string]any{"event": "exit"})}
	if d.exit["diagnostics"] == nil {
		t.Fatalf("the exit line names no diagnostics: %v", d.exit)
	}
	tracePath, _ := d.exit["trace"].(string)
	goroutinesPath, _ := d.exit["goroutines"].(string)
	for _, f := range []string{tracePath, goroutinesPath} {
		if filepath.Dir(f) != env["KUMIKO_DIAGNOSTICS_DIR"] {
			t.Fatalf("exit line file %q is not in KUMIKO_DIAGNOSTICS_DIR %s", f, env["KUMIKO_DIAGNOSTICS_DIR"])
		}
	}
	d.trace = parseTrace(t, tracePath)
	d.goroutines = string(must(os.ReadFile(goroutinesPath)))
	d.termination = string(must(os.ReadFile(env["KUMIKO_TERMINATION_LOG"])))
	for _, want := range []string{filepath.Base(tracePath), filepath.Base(goroutinesPath), firstReason(d.exit)} {
		if !strings.Contains(d.termination, want) {
			t.Errorf("the termination message does not name %q:\n%s", want, d.termination)
		}
	}
	return d
}

// parseTrace checks that the Go toolchain parses the trace file and returns
// its events as text.
func parseTrace(t *testing.T, path string) string {
	t.Helper()
	out, err := exec.Command("go", "tool", "trace", "-d=parsed", path).CombinedOutput()
	if err != nil {
		t.Fatalf("go tool trace -d=parsed %s: %v\n%s", path, err, lastLines(string(out), 20))
	}
	return string(out)
}

// firstReason is the first incident's reason in the exit line.
func firstReason(exit map[string]any) string {
	first, _, _ := strings.Cut(exit["diagnostics"].(string), " | ")
	return first
}

// stuckWith returns the dump's records whose labels include label (as the
// dump prints it, `"key":"value"`) and whose stack has frame.
func stuckWith(dump, label, frame string) []string {
	var found []string
	for record := range strings.SplitSeq(dump, "\n\n") {
		if strings.Contains(record, "# labels: ") && strings.Contains(record, label) && strings.Contains(record, frame) {
			found = append(found, record)
		}
	}
	return found
}

// drainPastASlowRequest starts the service with env, holds a request in
// flight past its KUMIKO_DRAIN_TIMEOUT and sends SIGTERM: the drain
// force-closes the request and the process exits 0 (a force-closed request
// is no failure).
func drainPastASlowRequest(t *testing.T, env map[string]string) *proc {
	t.Helper()
	p := startProc(t, env)
	ops, api := p.waitReady()
	go func() {
		if resp, err := http.Get(api + "/api/slow?ms=30000"); err == nil {
			resp.Body.Close()
		}
	}()
	waitInFlight(t, ops)
	p.signal(syscall.SIGTERM)
	if code := p.wait(10 * time.Second); code != 0 {
		t.Fatalf("exit code %d, want 0: a force-closed request is no failure", code)
	}
	return p
}

// A request still running at KUMIKO_DRAIN_TIMEOUT is force-closed (exit 0,
// as before) and named with its route and where it was blocked; the trace
// has the drain's steps as regions; the dump shows the request's goroutine,
// labelled with its route, in the handler.
func TestDiagnosticsOfAForceClosedRequest(t *testing.T) {
	t.Parallel()
	env := fastEnv(t, "KUMIKO_FLIGHT_RECORDER=true", "KUMIKO_LINGER=0", "KUMIKO_DRAIN_TIMEOUT=300ms", "KUMIKO_SHUTDOWN_TIMEOUT=5s")
	p := drainPastASlowRequest(t, env)
	d := readDiagnosed(t, p, env)
	reason := firstReason(d.exit)
	t.Logf("exit line: %s", reason)
	for _, want := range []string{"inFlight: 1 request force-closed", "GET /api/slow", "blocked in", "handleSlow"} {
		if !strings.Contains(reason, want) {
			t.Errorf("the exit line's reason %q does not say %q", reason, want)
		}
	}
	for _, want := range []string{`Type="step inFlight"`, `Type="route GET /api/slow"`, `Category="incident"`, `TaskBegin`} {
		if !strings.Contains(d.trace, want) {
			t.Errorf("the trace has no %s", want)
		}
	}
	if len(stuckWith(d.goroutines, `"route":"GET /api/slow"`, "handleSlow")) == 0 {
		t.Errorf("no goroutine labelled with the route stuck in the handler:\n%s", d.goroutines)
	}
	if len(stuckWith(d.goroutines, `"step":"inFlight"`, "main.(*app).awaitInFlight")) == 0 {
		t.Errorf("no drain goroutine labelled step=inFlight:\n%s", d.goroutines)
	}
	if !strings.HasPrefix(d.termination, serviceName+" "+env["KUMIKO_INSTANCE_ID"]+" exited 0") {
		t.Errorf("termination message: %s", d.termination)
	}
}

// Without the flight recorder (the default) a force-closed request still
// leaves the goroutine dump with its route, the exit line and the
// termination message; only the trace is missing.
func TestDiagnosticsWithoutTheRecorder(t *testing.T) {
	t.Parallel()
	env := fastEnv(t, "KUMIKO_LINGER=0", "KUMIKO_DRAIN_TIMEOUT=300ms", "KUMIKO_SHUTDOWN_TIMEOUT=5s")
	p := drainPastASlowRequest(t, env)
	exit := p.waitLog(time.Second, map[string]any{"event": "exit"})
	if reason, _ := exit["diagnostics"].(string); !strings.Contains(reason, "GET /api/slow, blocked in") {
		t.Errorf("the exit line's reason %q does not name the request", reason)
	}
	if exit["trace"] != nil {
		t.Errorf("a trace without a recorder: %v", exit["trace"])
	}
	dump := string(must(os.ReadFile(exit["goroutines"].(string))))
	if len(stuckWith(dump, `"route":"GET /api/slow"`, "handleSlow")) == 0 {
		t.Errorf("no goroutine labelled with the route stuck in the handler:\n%s", dump)
	}
	if msg := string(must(os.ReadFile(env["KUMIKO_TERMINATION_LOG"]))); !strings.Contains(msg, "inFlight: 1 request force-closed") {
		t.Errorf("termination message: %s", msg)
	}
}

// A release hook held by a hung dependency — Redis behind a black hole —
// fails at its own bound; its goroutine was looked at while it was still
// stuck, so the dump shows it, labelled with its step, in the Redis call.
func TestDiagnosticsOfAHookHeldByAHungDependency(t *testing.T) {
	t.Parallel()
	tp := testToxiproxy(t)
	rd := testRedis(t)
	proxy := proxyTo(t, tp, "redis", rd.Addr)
	env := fastEnv(t, "KUMIKO_FLIGHT_RECORDER=true", "REDIS_URL="+withHost(t, rd.URL, proxy.Listen), "KUMIKO_LINGER=0", "KUMIKO_SHUTDOWN_TIMEOUT=20s")
	p := startProc(t, env)
	p.waitReady()
	restore := blackHole(t, proxy)
	defer restore()
	p.signal(syscall.SIGTERM)
	p.wait(30 * time.Second) // best-effort Redis releases: the code depends on which hooks fail; the diagnostics do not
	d := readDiagnosed(t, p, env)
	reason := firstReason(d.exit)
	t.Logf("exit line: %s", d.exit["diagnostics"])
	hook, _, ok := strings.Cut(reason, ": release hook failed")
	if !ok {
		t.Fatalf("the first incident %q is no failed release hook", reason)
	}
	if !strings.Contains(reason, "blocked in") {
		t.Errorf("the reason %q does not say where the hook was blocked", reason)
	}
	if !strings.Contains(d.trace, `Type="step `+hook+`"`) {
		t.Errorf("the trace has no region of step %s", hook)
	}
	// The hook's goroutine, or its component's that the hook's Stop waits for.
	if len(stuckWith(d.goroutines, `"step":"`+hook+`"`, "go-redis"))+len(stuckWith(d.goroutines, `"component":"`+hook+`"`, "go-redis")) == 0 {
		t.Errorf("no goroutine labelled step=%s or component=%[1]s stuck in a Redis call:\n%s", hook, d.goroutines)
	}
}

// A clean drain leaves nothing: no files, no termination message, and an exit
// line without diagnostics.
func TestCleanDrainLeavesNoDiagnostics(t *testing.T) {
	t.Parallel()
	env := fastEnv(t, "KUMIKO_FLIGHT_RECORDER=true")
	p := startProc(t, env)
	p.waitReady()
	p.signal(syscall.SIGTERM)
	if code := p.wait(10 * time.Second); code != 0 {
		t.Fatalf("exit code %d", code)
	}
	if exit := p.waitLog(time.Second, map[string]any{"event": "exit"}); exit["diagnostics"] != nil || exit["trace"] != nil {
		t.Errorf("a clean drain's exit line names diagnostics: %v", exit)
	}
	entries, err := os.ReadDir(env["KUMIKO_DIAGNOSTICS_DIR"])
	if err != nil || len(entries) != 0 {
		t.Errorf("a clean drain left %v in the diagnostics dir (%v)", entries, err)
	}
	if _, err := os.Stat(env["KUMIKO_TERMINATION_LOG"]); !os.IsNotExist(err) {
		t.Errorf("a clean drain wrote a termination message (%v)", err)
	}
}

// POST /admin/diagnostics writes a snapshot now, behind the token; GET lists
// the files and serves them.
func TestDiagnosticsSnapshotOnDemand(t *testing.T) {
	t.Parallel()
	env := fastEnv(t, "KUMIKO_FLIGHT_RECORDER=true", "KUMIKO_ADMIN_TOKEN="+testAdminToken)
	p := startProc(t, env)
	ops, _ := p.waitReady()
	auth := "Bearer " + testAdminToken
	post := func(auth string) *http.Response {
		req := must(http.NewRequest(http.MethodPost, ops+"/admin/diagnostics", nil))
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, _ := roundTrip(t, nil, req)
		return resp
	}
	if resp := post(""); resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("without the token: %d, want 401", resp.StatusCode)
	}
	req := must(http.NewRequest(http.MethodPost, ops+"/admin/diagnostics", nil))
	req.Header.Set("Authorization", auth)
	resp, body := roundTrip(t, nil, req)
	var files map[string]string
	if resp.StatusCode != http.StatusCreated || json.Unmarshal(body, &files) != nil || files["trace"] == "" || files["goroutines"] == "" {
		t.Fatalf("snapshot: %d %s", resp.StatusCode, body)
	}
	resp, body = getBody(t, ops+"/admin/diagnostics", auth)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), files["trace"]) {
		t.Errorf("list: %d %s", resp.StatusCode, body)
	}
	resp, body = getBody(t, ops+"/admin/diagnostics/"+files["trace"], auth)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("download: %d %s", resp.StatusCode, body)
	}
	downloaded := filepath.Join(t.TempDir(), "snapshot.trace")
	if err := os.WriteFile(downloaded, body, 0o600); err != nil {
		t.Fatal(err)
	}
	if trace := parseTrace(t, downloaded); !strings.Contains(trace, "component ") {
		t.Errorf("the snapshot's trace names no component region")
	}
	if resp, _ := getBody(t, ops+"/admin/diagnostics/..%2Fconfig", auth); resp.StatusCode != http.StatusNotFound {
		t.Errorf("a name outside the directory: %d, want 404", resp.StatusCode)
	}
	// An on-demand snapshot is no incident: the drain stays clean.
	p.signal(syscall.SIGTERM)
	if code := p.wait(10 * time.Second); code != 0 {
		t.Fatalf("exit code %d", code)
	}
	if exit := p.waitLog(time.Second, map[string]any{"event": "exit"}); exit["diagnostics"] != nil {
		t.Errorf("the exit line names the on-demand snapshot: %v", exit)
	}
}
