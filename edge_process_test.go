package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// dialBase opens a raw TCP connection to a base URL ("http://host:port").
func dialBase(t *testing.T, base string) net.Conn {
	t.Helper()
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// rawHealthRequest is a keep-alive GET /health, for tests that hold a raw
// connection open between requests.
const rawHealthRequest = "GET /health HTTP/1.1\r\nHost: kumiko\r\n\r\n"

// readAnswer reads one response from r within the given time, its body drained.
func readAnswer(conn net.Conn, r *bufio.Reader, within time.Duration) (*http.Response, error) {
	conn.SetReadDeadline(time.Now().Add(within))
	resp, err := http.ReadResponse(r, nil)
	if err == nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	return resp, err
}

// waitClosed reads until the server closes the connection, and fails if it
// is still open after within (which is many times the timeout under test).
// Whatever the server sent before closing is returned.
func waitClosed(t *testing.T, conn net.Conn, r io.Reader, within time.Duration) string {
	t.Helper()
	conn.SetReadDeadline(time.Now().Add(within))
	got, err := io.ReadAll(r)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("the server kept the connection open for %s; it sent %q", within, got)
	}
	return string(got)
}

// With Postgres unreachable, the API port's readiness tells only that the db
// check failed; the ops port tells why.
func TestProcessReadinessDetailsOnlyOnOpsPort(t *testing.T) {
	env := fastEnv(t)
	p := startProc(t, env)
	ops, api := p.waitReady()

	u, err := url.Parse(env["DATABASE_URL"])
	if err != nil {
		t.Fatal(err)
	}
	dbName := strings.TrimPrefix(u.Path, "/")
	admin, err := pgx.Connect(context.Background(), strings.Replace(env["DATABASE_URL"], "/"+dbName, "/postgres", 1))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	// The database refuses new connections and its open ones end: for the
	// service it is down, with a driver error naming the database.
	if _, err := admin.Exec(context.Background(), "ALTER DATABASE "+dbName+" ALLOW_CONNECTIONS false"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(context.Background(), "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", dbName); err != nil {
		t.Fatal(err)
	}

	readBody := func(base string) (int, string) {
		resp, err := http.Get(base + "/health/ready")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(raw)
	}
	var opsBody string
	var code int
	if !poll(15*time.Second, 50*time.Millisecond, func() bool { // a probe whose cache TTL is 100ms
		code, opsBody = readBody(ops)
		return code == 503 && strings.Contains(opsBody, dbName)
	}) {
		t.Fatalf("the ops port never reported the database down: %d %s", code, opsBody)
	}
	code, apiBody := readBody(api)
	var rep struct {
		Status string
		Checks map[string]map[string]any
	}
	if err := json.Unmarshal([]byte(apiBody), &rep); err != nil {
		t.Fatalf("API readiness body %q: %v", apiBody, err)
	}
	if code != 503 || rep.Status != "not_ready" || rep.Checks["db"]["ok"] != false {
		t.Fatalf("API readiness with the database down: %d %s", code, apiBody)
	}
	for name, check := range rep.Checks {
		if len(check) != 1 {
			t.Errorf("API readiness check %s has details: %v", name, check)
		}
	}
	for _, leak := range []string{dbName, "error", "user=", "latencyMs"} {
		if strings.Contains(apiBody, leak) {
			t.Errorf("API readiness body contains %q: %s", leak, apiBody)
		}
	}
	if !strings.Contains(opsBody, `"error"`) {
		t.Errorf("ops readiness body lacks the error: %s", opsBody)
	}
}

// OTLP endpoint credentials and header values are secrets: not in the log,
// not in the ops readiness body, not on the dashboard.
func TestProcessOTLPCredentialsMasked(t *testing.T) {
	env := fastEnv(t,
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://otlp-user:otlp-Pa55word@127.0.0.1:1/?token=otlp-query-token", // nothing listens
		"OTEL_EXPORTER_OTLP_HEADERS=x-api-key=otlp-header-secret",
	)
	p := startProc(t, env)
	ops, api := p.waitReady()
	// The failed endpoint is reported (masked) by the observability phase.
	p.waitLog(5*time.Second, map[string]any{"phase": "observability"})
	texts := map[string]string{"log": p.logText()}
	for name, u := range map[string]string{"ops readiness": ops + "/health/ready", "api readiness": api + "/health/ready", "instance": api + "/api/instance"} {
		resp, err := http.Get(u)
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		texts[name] = string(raw)
	}
	if !strings.Contains(texts["ops readiness"], "does not answer") {
		t.Errorf("ops readiness does not report the OTLP problem: %s", texts["ops readiness"])
	}
	for name, text := range texts {
		for _, secret := range []string{"otlp-Pa55word", "otlp-user", "otlp-query-token", "otlp-header-secret"} {
			if strings.Contains(text, secret) {
				t.Errorf("%s contains %q", name, secret)
			}
		}
	}
}

// At KUMIKO_API_MAX_CONNS open connections the API port stops accepting: the
// next connection waits in the kernel's queue, unanswered and costing the
// process nothing, until one of the open ones closes. The ops port, where the
// probes go, still answers.
func TestProcessAPIConnectionCap(t *testing.T) {
	env := fastEnv(t, "KUMIKO_API_MAX_CONNS=2", "KUMIKO_SSE_MAX_STREAMS=1")
	p := startProc(t, env)
	ops, api := p.waitReady()

	ask := func(conn net.Conn) *bufio.Reader {
		t.Helper()
		if _, err := io.WriteString(conn, rawHealthRequest); err != nil {
			t.Fatal(err)
		}
		return bufio.NewReader(conn)
	}
	answered := func(conn net.Conn, r *bufio.Reader, within time.Duration) int {
		t.Helper()
		res, err := readAnswer(conn, r, within)
		if err != nil {
			t.Fatalf("no answer within %s: %v", within, err)
		}
		return res.StatusCode
	}
	// Two keep-alive connections, each answered once and left open, fill the cap.
	held := []net.Conn{dialBase(t, api), dialBase(t, api)}
	for _, conn := range held {
		if code := answered(conn, ask(conn), 10*time.Second); code != http.StatusOK {
			t.Fatalf("GET /health on a held connection: %d", code)
		}
	}
	waitFor(t, 10*time.Second, "kumiko_api_connections to reach the cap of 2", func() bool {
		n, err := scrapeMetric(ops, "kumiko_api_connections")
		return err == nil && n == 2
	})

	// The third connects (the kernel completes the handshake) but is not
	// accepted: its request is not read. Without the cap the answer comes
	// in about a millisecond.
	third := dialBase(t, api)
	r := ask(third)
	third.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if b, err := r.Peek(1); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("a connection past the cap was answered: %q, %v", b, err)
	}
	if code, _, _, err := get(t, http.DefaultClient, ops+"/health/ready"); err != nil || code != http.StatusOK {
		t.Fatalf("ops /health/ready at the cap: %d, %v", code, err)
	}

	// One held connection closes: the waiting one is accepted and answered.
	held[0].Close()
	if code := answered(third, r, 10*time.Second); code != http.StatusOK {
		t.Fatalf("GET /health on the connection that waited: %d", code)
	}
}
