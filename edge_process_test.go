package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
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

// The server's timeouts hold against idle, slow-body and slow-header clients
// on both listeners.
func TestProcessServerTimeouts(t *testing.T) {
	env := fastEnv(t)
	env["KUMIKO_HTTP_IDLE_TIMEOUT"] = "300ms"
	env["KUMIKO_HTTP_READ_TIMEOUT"] = "300ms"
	env["KUMIKO_HTTP_READ_HEADER_TIMEOUT"] = "200ms"
	p := startProc(t, env)
	ops, api := p.waitReady()

	for name, base := range map[string]string{"api": api, "ops": ops} {
		t.Run("idle keep-alive closed/"+name, func(t *testing.T) {
			conn := dialBase(t, base)
			fmt.Fprintf(conn, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
			br := bufio.NewReader(conn)
			conn.SetReadDeadline(time.Now().Add(5 * time.Second))
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || resp.Close {
				t.Fatalf("first request: %d, close=%t; want a kept-alive 200", resp.StatusCode, resp.Close)
			}
			if rest := waitClosed(t, conn, br, 4*time.Second); rest != "" {
				t.Fatalf("the server sent %q on an idle connection", rest)
			}
		})
		t.Run("slowloris headers cut/"+name, func(t *testing.T) {
			conn := dialBase(t, base)
			fmt.Fprintf(conn, "GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ") // and nothing more
			// The old fixed ReadHeaderTimeout was 5s: 3s tells the setting apart.
			waitClosed(t, conn, conn, 3*time.Second)
		})
	}

	t.Run("oversized headers refused", func(t *testing.T) {
		req, _ := http.NewRequest(http.MethodGet, api+"/health", nil)
		req.Header.Set("X-Big", strings.Repeat("x", 2*maxHeaderBytes)) // under net/http's 1 MB default
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("a %d-byte header: %d, want 431", 2*maxHeaderBytes, resp.StatusCode)
		}
	})
	t.Run("stalled body cut", func(t *testing.T) {
		conn := dialBase(t, api)
		fmt.Fprintf(conn, "POST /api/orders HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"customer")
		got := waitClosed(t, conn, conn, 4*time.Second)
		if !strings.HasPrefix(got, "HTTP/1.1 408") || !strings.Contains(got, "request_timeout") {
			t.Fatalf("answer to a stalled body: %q, want a 408 request_timeout", got)
		}
	})
}

// One client IP that bursts gets 429 with Retry-After; another IP is not
// affected, nor are the health routes.
func TestProcessRateLimitPerClientIP(t *testing.T) {
	env := fastEnv(t)
	env["KUMIKO_API_RATE_LIMIT"] = "1"
	env["KUMIKO_API_RATE_BURST"] = "3"
	p := startProc(t, env)
	_, api := p.waitReady()

	client := func(ip string) *http.Client {
		d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
		return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: d.DialContext}}
	}
	first := client("127.0.0.1")
	var statuses []int
	limited := false
	for range 20 {
		code, hdr, body, err := get(t, first, api+"/api/orders")
		if err != nil {
			t.Fatal(err)
		}
		statuses = append(statuses, code)
		if code == http.StatusTooManyRequests {
			errBody, _ := body["error"].(map[string]any)
			if secs, err := strconv.Atoi(hdr.Get("Retry-After")); err != nil || secs < 1 || errBody["code"] != "rate_limited" {
				t.Fatalf("429 with Retry-After %q and body %v", hdr.Get("Retry-After"), body)
			}
			limited = true
			break
		}
	}
	if !limited {
		t.Fatalf("20 requests from one IP at burst 3, 1/s: statuses %v, want a 429", statuses)
	}
	for range 10 {
		if code, _, _, err := get(t, first, api+"/health/ready"); err != nil || code == http.StatusTooManyRequests {
			t.Fatalf("readiness on the API port while rate-limited: %d %v", code, err)
		}
	}
	if code, _, body, err := get(t, client("127.0.0.2"), api+"/api/orders"); err != nil || code != 200 {
		t.Fatalf("another client IP: %d %v %v", code, body, err)
	}
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
	deadline := time.Now().Add(15 * time.Second)
	for {
		var code int
		code, opsBody = readBody(ops)
		if code == 503 && strings.Contains(opsBody, dbName) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ops port never reported the database down: %d %s", code, opsBody)
		}
		time.Sleep(50 * time.Millisecond) // polling a probe whose cache TTL is 100ms
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
	env := fastEnv(t)
	env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://otlp-user:otlp-Pa55word@127.0.0.1:1/?token=otlp-query-token" // nothing listens
	env["OTEL_EXPORTER_OTLP_HEADERS"] = "x-api-key=otlp-header-secret"
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

// Behind a trusted proxy the client is the address it forwarded; from anyone
// else X-Forwarded-For is ignored, so a client cannot pose as many.
func TestProcessRateLimitBelievesOnlyTrustedProxies(t *testing.T) {
	for _, tc := range []struct {
		name, trusted string
		separate      bool // two forwarded clients get a bucket each
	}{
		{"untrusted", "", false},
		{"trusted", "127.0.0.1", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := fastEnv(t)
			env["KUMIKO_API_RATE_LIMIT"] = "1"
			env["KUMIKO_API_RATE_BURST"] = "2"
			env["KUMIKO_TRUSTED_PROXIES"] = tc.trusted
			p := startProc(t, env)
			_, api := p.waitReady()
			status := func(forwardedFor string) int {
				req, _ := http.NewRequest(http.MethodGet, api+"/api/orders", nil)
				req.Header.Set("X-Forwarded-For", forwardedFor)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				resp.Body.Close()
				return resp.StatusCode
			}
			var first []int
			for len(first) < 10 && (len(first) == 0 || first[len(first)-1] != http.StatusTooManyRequests) {
				first = append(first, status("203.0.113.1"))
			}
			if first[len(first)-1] != http.StatusTooManyRequests {
				t.Fatalf("requests at burst 2, 1/s from client 203.0.113.1: %v, want a 429", first)
			}
			other := status("203.0.113.2") // at once: the shared bucket, if it is shared, is still empty
			if got := other != http.StatusTooManyRequests; got != tc.separate {
				t.Fatalf("trusted %q: client 203.0.113.2 after 203.0.113.1 was limited got %d; want a bucket of its own = %v",
					tc.trusted, other, tc.separate)
			}
		})
	}
}
