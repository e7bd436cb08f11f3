package main

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The phase names are part of the contract: logs, metrics, spans and the
// readiness body use them.
var phaseOrder = []string{"config", "observability", "secrets", "runtimeChecks", "featureRegister",
	"bootValidation", "dbConnect", "schemaBaseline", "migrationsCheck", "redisConnect", "searchAdapter",
	"fileStorage", "outboxPoller", "jobsWorker", "apiListener", "ready"}

// 1. A normal boot: 16 phase lines in order, then starting→ready, and a
// readiness body with the checks.
func TestProcessNormalBoot(t *testing.T) {
	p := startProc(t, fastEnv(t))
	ops, api := p.waitReady()

	phases := p.logsMatching(map[string]any{"msg": "lifecycle", "component": "lifecycle"})
	var names []string
	for _, l := range phases {
		if name, ok := l["phase"].(string); ok && l["outcome"] != nil {
			names = append(names, name)
			if _, ok := l["duration_ms"].(float64); !ok {
				t.Errorf("phase %s has no integer duration_ms: %v", name, l)
			}
			if _, ok := l["retries"].(float64); !ok {
				t.Errorf("phase %s has no retries: %v", name, l)
			}
		}
	}
	if strings.Join(names, ",") != strings.Join(phaseOrder, ",") {
		t.Fatalf("phases logged\n got %v\nwant %v", names, phaseOrder)
	}
	skipped := p.logsMatching(map[string]any{"phase": "searchAdapter", "outcome": "skipped"})
	if len(skipped) != 1 || skipped[0]["note"] == nil {
		t.Errorf("an unconfigured search adapter must log outcome=skipped with a reason, got %v", skipped)
	}
	p.waitLog(time.Second, map[string]any{"event": "state_changed", "from": "starting", "to": "ready"})
	// Every line says which service and which instance wrote it, so merged logs stay readable.
	for _, l := range p.logsMatching(map[string]any{"msg": "lifecycle"}) {
		if l["service"] != serviceName || l["instance"] != "test-"+t.Name() {
			t.Fatalf("log line without service=%s and instance=test-%s: %v", serviceName, t.Name(), l)
		}
	}

	for _, base := range []string{ops, api} {
		code, _, body, err := get(t, http.DefaultClient, base+"/health/ready")
		if err != nil || code != 200 {
			t.Fatalf("%s/health/ready = %d, %v; want 200", base, code, err)
		}
		if body["status"] != "ready" || body["state"] != "ready" {
			t.Errorf("readiness body %v", body)
		}
		checks, _ := body["checks"].(map[string]any)
		for _, name := range []string{"db", "redis", "observability", "outboxPoller", "jobsWorker", "schedulerLeader"} {
			c, _ := checks[name].(map[string]any)
			if c["ok"] != true {
				t.Errorf("check %s = %v, want ok", name, c)
			}
		}
		if base == api {
			// The public port tells status only: details stay on the ops port.
			for name, c := range checks {
				if c, _ := c.(map[string]any); len(c) != 1 {
					t.Errorf("API port check %s = %v, want only ok", name, c)
				}
			}
		} else {
			if _, ok := checks["db"].(map[string]any)["latencyMs"]; !ok {
				t.Errorf("db check has no latencyMs: %v", checks["db"])
			}
			// Components that are off say so, with the reason, and do not fail readiness.
			for _, name := range []string{"search", "storage"} {
				c, _ := checks[name].(map[string]any)
				if c["ok"] != true || c["skipped"] == nil {
					t.Errorf("check %s = %v, want ok with the reason it is skipped", name, c)
				}
			}
		}
		code, _, body, _ = get(t, http.DefaultClient, base+"/health")
		if code != 200 || body["status"] != "alive" {
			t.Errorf("%s/health = %d %v", base, code, body)
		}
	}

	p.signal(syscall.SIGTERM)
	if code := p.wait(10 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
}

// 2. DB down at boot: retries with growing delays, then exit 1 naming the
// phase, the attempts and the last error.
func TestProcessDBDownAtBoot(t *testing.T) {
	env := fastEnv(t,
		"DATABASE_URL=postgres://kumiko:s3cr3t-pw@"+freeTCPAddr(t)+"/kumiko?sslmode=disable",
		"KUMIKO_CONNECT_RETRY_BASE=50ms",
		"KUMIKO_CONNECT_MAX_WAIT=1s",
	)
	p := startProc(t, env)
	if code := p.wait(10 * time.Second); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}

	var delays []float64
	for _, l := range p.logsMatching(map[string]any{"msg": "connect failed", "target": "db"}) {
		delays = append(delays, l["retry_in_ms"].(float64))
	}
	if len(delays) < 4 {
		t.Fatalf("want at least 4 retries in 1s with a 50ms base, got delays %v", delays)
	}
	for i, want := range []float64{50, 100, 200, 400} {
		if delays[i] != want {
			t.Errorf("retry %d delay %vms, want %vms (sequence %v)", i+1, delays[i], want, delays)
		}
	}
	failed := p.waitLog(time.Second, map[string]any{"phase": "dbConnect", "outcome": "failed"})
	msg := failed["error"].(string) + " / " + p.stderr.String()
	for _, want := range []string{"dbConnect", "attempts", "last error", "connect"} {
		if !strings.Contains(msg, want) {
			t.Errorf("failure message lacks %q: %s", want, msg)
		}
	}
	if strings.Contains(p.logText()+p.stderr.String(), "s3cr3t-pw") {
		t.Error("the database password appeared in the output")
	}
}

// 3. SIGTERM: readiness 503 at once, an in-flight request completes, new
// connections are refused after the linger, exit 0 in time.
func TestProcessSIGTERMDrain(t *testing.T) {
	env := fastEnv(t, "KUMIKO_LINGER=500ms")
	p := startProc(t, env)
	ops, api := p.waitReady()

	slow := make(chan int, 1)
	go func() {
		resp, err := http.Get(api + "/api/slow?ms=1500")
		if err != nil {
			slow <- -1
			return
		}
		resp.Body.Close()
		slow <- resp.StatusCode
	}()
	waitInFlight(t, ops)

	start := time.Now()
	p.signal(syscall.SIGTERM)
	p.waitLog(2*time.Second, map[string]any{"event": "state_changed", "to": "draining"})
	if code, _, body, _ := get(t, http.DefaultClient, ops+"/health/ready"); code != 503 || body["state"] != "draining" {
		t.Errorf("readiness right after SIGTERM = %d %v, want 503 draining", code, body)
	}

	// During the linger the API still serves, and tells the client to go
	// elsewhere next time (Go's client turns "Connection: close" into resp.Close).
	resp, err := http.Get(api + "/api/slow?ms=0")
	if err != nil {
		t.Fatalf("request during linger: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || !resp.Close {
		t.Errorf("request during linger = %d, Connection: close = %v; want 200 with Connection: close", resp.StatusCode, resp.Close)
	}

	p.waitLog(2*time.Second, map[string]any{"step": "closeListener"})
	if conn, err := net.DialTimeout("tcp", strings.TrimPrefix(api, "http://"), time.Second); err == nil {
		conn.Close()
		t.Error("a new connection was accepted after the linger")
	}
	if got := <-slow; got != 200 {
		t.Errorf("in-flight request ended with %d, want 200", got)
	}
	if code := p.wait(10 * time.Second); code != 0 {
		t.Fatalf("exit code %d, want 0", code)
	}
	// linger 0.5s + the rest of a 1.5s request + margin for a loaded CI machine.
	if took := time.Since(start); took > 4*time.Second {
		t.Errorf("SIGTERM to exit took %s", took)
	}
}

// A keep-alive connection that is idle when SIGTERM arrives stays open through
// the linger: a load balancer that has not yet seen the 503 may send its next
// request on it at that very moment. The request is answered, with
// Connection: close, and only then is the connection closed.
func TestProcessIdleKeepAliveSurvivesTheStartOfTheDrain(t *testing.T) {
	env := fastEnv(t, "KUMIKO_LINGER=3s")
	p := startProc(t, env)
	_, api := p.waitReady()

	conn := dialBase(t, api)
	r := bufio.NewReader(conn)
	ask := func() (*http.Response, error) {
		if _, err := io.WriteString(conn, rawHealthRequest); err != nil {
			return nil, err
		}
		return readAnswer(conn, r, 5*time.Second)
	}
	if resp, err := ask(); err != nil || resp.StatusCode != 200 || resp.Close {
		t.Fatalf("before SIGTERM: %v %v, want 200 keep-alive", resp, err)
	}

	p.signal(syscall.SIGTERM)
	p.waitLog(2*time.Second, map[string]any{"step": "readiness"})
	resp, err := ask()
	if err != nil || resp.StatusCode != 200 || !resp.Close {
		t.Fatalf("on the idle connection, during the linger: %v %v; want 200 with Connection: close", resp, err)
	}
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d, want 0", code)
	}
}

// A connection that never sends a request (a browser's preconnect) does not
// hold the drain: net/http's Shutdown would count it as busy for 5 s, the
// drain closes it once it has been silent for silentConnGrace.
func TestProcessSilentConnectionDoesNotHoldTheDrain(t *testing.T) {
	env := fastEnv(t,
		"KUMIKO_LINGER=0",
		"KUMIKO_HTTP_READ_HEADER_TIMEOUT=60s", // net/http's own limit stays out of the way
	)
	p := startProc(t, env)
	_, api := p.waitReady()

	silent := dialBase(t, api)
	// The server accepts in order: once a later connection is answered, the
	// silent one has been accepted too.
	if resp, err := http.Get(api + "/health"); err != nil {
		t.Fatal(err)
	} else {
		resp.Body.Close()
	}
	p.signal(syscall.SIGTERM)
	closed := p.waitLog(10*time.Second, map[string]any{"step": "inFlight", "msg": "closed connections that sent no request"})
	if closed["connections"].(float64) < 1 {
		t.Errorf("the drain closed %v silent connections, want at least 1", closed["connections"])
	}
	silent.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := silent.Read(make([]byte, 1)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("the silent connection is still open after the drain closed it: read %d bytes, %v", n, err)
	}
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d, want 0", code)
	}
}

// 4. A request longer than the drain timeout is force-closed with a warning,
// and the process still exits within its budget.
func TestProcessDrainTimeoutForceCloses(t *testing.T) {
	env := fastEnv(t, "KUMIKO_LINGER=0", "KUMIKO_DRAIN_TIMEOUT=300ms", "KUMIKO_SHUTDOWN_TIMEOUT=3s")
	p := startProc(t, env)
	ops, api := p.waitReady()

	slow := make(chan error, 1)
	go func() {
		resp, err := http.Get(api + "/api/slow?ms=30000")
		if err == nil {
			resp.Body.Close()
		}
		slow <- err
	}()
	waitInFlight(t, ops)
	p.signal(syscall.SIGTERM)

	warn := p.waitLog(3*time.Second, map[string]any{"step": "inFlight", "level": "warning"})
	if warn["requests"].(float64) != 1 {
		t.Errorf("force-close warning counts %v requests, want 1", warn["requests"])
	}
	if code := p.wait(3 * time.Second); code != 0 {
		t.Fatalf("exit code %d, want 0", code)
	}
	if err := <-slow; err == nil {
		t.Error("the force-closed request got a complete response")
	}
}

// 6a. A port in use ends the boot at once, in the apiListener phase.
func TestProcessPortInUse(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	env := fastEnv(t, "KUMIKO_HTTP_ADDR="+ln.Addr().String())
	p := startProc(t, env)
	if code := p.wait(10 * time.Second); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}
	failed := p.waitLog(time.Second, map[string]any{"phase": "apiListener", "outcome": "failed"})
	if !strings.Contains(failed["error"].(string), "address already in use") {
		t.Errorf("apiListener error: %v", failed["error"])
	}
}

// 6b. Invalid config with three mistakes: exit 1 listing all three.
func TestProcessInvalidConfigListsEveryProblem(t *testing.T) {
	p := startProc(t, map[string]string{
		"KUMIKO_LOG_FORMAT":      "json",
		"KUMIKO_LINGER":          "soon",
		"KUMIKO_MIGRATIONS_MODE": "sometimes",
		"REDIS_URL":              "redis://127.0.0.1:1",
		// DATABASE_URL missing
	})
	if code := p.wait(10 * time.Second); code != 1 {
		t.Fatalf("exit code %d, want 1", code)
	}
	out := p.stderr.String()
	for _, want := range []string{"KUMIKO_LINGER", "KUMIKO_MIGRATIONS_MODE", "DATABASE_URL"} {
		if !strings.Contains(out, want) {
			t.Errorf("config error does not name %s:\n%s", want, out)
		}
	}
	p.waitLog(time.Second, map[string]any{"phase": "config", "outcome": "failed"})
}

// 7. SIGHUP is ignored; a second SIGINT while draining forces exit 1 at once.
func TestProcessSIGHUPIgnoredAndSecondSignalForces(t *testing.T) {
	env := fastEnv(t,
		"KUMIKO_LINGER=20s", "KUMIKO_LINGER_QUIET=20s", // a fixed linger: the second signal comes during it
		"KUMIKO_SHUTDOWN_TIMEOUT=60s",
	)
	env["KUMIKO_DRAIN_TIMEOUT"] = "30s"
	p := startProc(t, env)
	ops, _ := p.waitReady()

	p.signal(syscall.SIGHUP)
	p.waitLog(2*time.Second, map[string]any{"signal": "hangup"})
	if code, _, _, _ := get(t, http.DefaultClient, ops+"/health/ready"); code != 200 {
		t.Fatalf("readiness after SIGHUP = %d, want 200", code)
	}

	p.signal(syscall.SIGINT)
	p.waitLog(2*time.Second, map[string]any{"step": "readiness"})
	start := time.Now()
	p.signal(syscall.SIGINT)
	if code := p.wait(5 * time.Second); code != 1 {
		t.Fatalf("exit code %d after a second SIGINT, want 1", code)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("second signal took %s to exit; it must not wait for the 20s linger", took)
	}
	// The drain left behind logs nothing after the exit line (issue 20: its
	// steps went on logging).
	p.mu.Lock()
	last := p.lines[len(p.lines)-1]
	p.mu.Unlock()
	if last["event"] != "exit" {
		t.Errorf("the last log line is %v, want the event=exit line", last)
	}
}

// 8. /health stays 200 and the ops listener stays up for the whole drain.
func TestProcessOpsListenerServesThroughTheDrain(t *testing.T) {
	env := fastEnv(t, "KUMIKO_LINGER=300ms")
	p := startProc(t, env)
	ops, api := p.waitReady()
	go http.Get(api + "/api/slow?ms=700")
	waitInFlight(t, ops)
	p.signal(syscall.SIGTERM)
	// Until the signal is handled, 200 is a legal answer: probe from draining on.
	p.waitLog(5*time.Second, map[string]any{"event": "state_changed", "to": "draining"})

	client := &http.Client{Timeout: time.Second}
	var alive, notReady int
	// Probe both every 20 ms until the process has exited.
	waitFor(t, 30*time.Second, "the process to exit", func() bool {
		select {
		case <-p.exited:
			return true
		default:
		}
		code, _, _, err := get(t, client, ops+"/health")
		if err != nil {
			// Only once the process is at its very last step may the ops
			// listener refuse. The child writes that step's line before it
			// closes the listener, but the line may still be in the pipe:
			// wait for it (waitLog fails the test if it never comes).
			p.waitLog(5*time.Second, map[string]any{"event": "state_changed", "to": "stopped"})
			<-p.exited
			return true
		}
		if code != 200 {
			t.Fatalf("/health = %d during the drain", code)
		}
		alive++
		if code, _, _, err := get(t, client, ops+"/health/ready"); err == nil {
			if code != 503 {
				t.Fatalf("/health/ready = %d during the drain", code)
			}
			notReady++
		}
		return false
	})
	if alive < 5 || notReady < 5 {
		t.Fatalf("probed %d /health and %d /health/ready during the drain; want several of each", alive, notReady)
	}
	if p.code != 0 {
		t.Fatalf("exit code %d", p.code)
	}
	// The last step closes the ops listener: it must come after every other step.
	steps := p.logsMatching(map[string]any{"msg": "lifecycle", "component": "lifecycle"})
	var last string
	for _, s := range steps {
		if name, ok := s["step"].(string); ok {
			last = name
		}
	}
	if last != "opsListener" {
		t.Errorf("last shutdown step %q, want opsListener", last)
	}
}

// SIGTERM while still starting aborts the boot cleanly: exit 0.
func TestProcessSIGTERMDuringBoot(t *testing.T) {
	env := fastEnv(t,
		"DATABASE_URL=postgres://kumiko@"+freeTCPAddr(t)+"/kumiko?sslmode=disable",
		"KUMIKO_CONNECT_MAX_WAIT=60s",
	)
	p := startProc(t, env)
	ops := p.addr("ops")
	p.waitLog(5*time.Second, map[string]any{"msg": "connect failed"})
	if code, _, body, _ := get(t, http.DefaultClient, ops+"/health/ready"); code != 503 || body["phase"] != "dbConnect" {
		t.Errorf("readiness while starting = %d %v, want 503 with phase dbConnect", code, body)
	}
	p.signal(syscall.SIGTERM)
	if code := p.wait(5 * time.Second); code != 0 {
		t.Fatalf("exit code %d, want 0 for a boot aborted by SIGTERM", code)
	}
	p.waitLog(time.Second, map[string]any{"event": "state_changed", "to": "stopped"})
}

// waitInFlight waits until the API has a request in flight (read from /metrics).
func waitInFlight(t *testing.T, ops string) {
	t.Helper()
	var n float64
	var err error
	if !poll(5*time.Second, 10*time.Millisecond, func() bool {
		n, err = scrapeMetric(ops, "kumiko_http_requests_in_flight")
		return err == nil && n == 1
	}) {
		t.Fatalf("no request in flight after 5s: kumiko_http_requests_in_flight = %v (%v), want 1", n, err)
	}
}
