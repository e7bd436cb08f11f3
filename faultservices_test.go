package main

// Test helpers for dependency faults, with real tools: a PostgreSQL cluster
// of a test's own, which the test may restart (as `pg_ctl restart -m fast`
// does) or freeze (SIGSTOP) without touching the shared one, and Toxiproxy,
// a TCP proxy made for fault injection, between the service and a
// dependency: latency, black holes, reset peers, bandwidth limits.

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2/client"
)

// ownPostgres is a PostgreSQL server of one test.
type ownPostgres struct {
	t                                 testing.TB
	URL                               string // superuser URL of the "postgres" database
	addr                              string // kept across restarts
	binDir, dataDir, sockDir, logPath string
	cred                              *syscall.Credential

	mu   sync.Mutex
	proc *childProcess
}

// testOwnPostgres initialises and starts a cluster for t alone; it is
// stopped and removed when t finishes.
func testOwnPostgres(t testing.TB) *ownPostgres {
	t.Helper()
	if os.Getenv("TEST_DATABASE_URL") != "" {
		t.Skip("test services: restarting or freezing PostgreSQL needs a server of the test's own, not TEST_DATABASE_URL")
	}
	binDir, err := findPostgresBinDir()
	if err != nil {
		failOrSkip(t, err)
	}
	cred, err := postgresCredential()
	if err != nil {
		failOrSkip(t, err)
	}
	baseDir, err := makePostgresBaseDir(cred)
	if err != nil {
		t.Fatalf("test services: %v", err)
	}
	srv, err := initAndStartPostgres(binDir, baseDir, cred)
	if err != nil {
		os.RemoveAll(baseDir)
		t.Fatalf("test services: %v", err)
	}
	u := srv.adminURL
	addr := strings.TrimSuffix(strings.TrimPrefix(u, "postgres://postgres@"), "/postgres?sslmode=disable")
	pg := &ownPostgres{t: t, URL: u, addr: addr, binDir: binDir, cred: cred, proc: srv.proc,
		dataDir: filepath.Join(baseDir, "data"), sockDir: filepath.Join(baseDir, "sock"), logPath: filepath.Join(baseDir, "postgres.log")}
	t.Cleanup(func() {
		pg.mu.Lock()
		defer pg.mu.Unlock()
		pg.signalAll(syscall.SIGCONT) // a frozen server cannot shut down
		pg.proc.stop(syscall.SIGQUIT, 10*time.Second)
		os.RemoveAll(baseDir)
	})
	return pg
}

// ownPostgresEnv is fastEnv with DATABASE_URL on a PostgreSQL of t's own,
// which t may restart or freeze.
func ownPostgresEnv(t testing.TB) (*ownPostgres, map[string]string) {
	t.Helper()
	pg := testOwnPostgres(t)
	env := fastEnv(t, "DATABASE_URL="+pg.URL)
	return pg, env
}

// Restart is a fast restart on the same port: every session is terminated
// (FATAL 57P01), then the server starts again and accepts connections.
func (pg *ownPostgres) Restart() {
	pg.t.Helper()
	pg.mu.Lock()
	defer pg.mu.Unlock()
	pg.proc.stop(syscall.SIGINT, 30*time.Second) // SIGINT is the postmaster's fast shutdown
	_, proc, err := launchPostgres(pg.binDir, pg.dataDir, pg.sockDir, pg.logPath, pg.addr, pg.cred)
	if err != nil {
		pg.t.Fatalf("test services: restarting postgres on %s: %v", pg.addr, err)
	}
	pg.proc = proc
}

// Freeze stops the postmaster and every backend (SIGSTOP): connections stay
// open and new ones are accepted by the kernel, but nothing is answered.
func (pg *ownPostgres) Freeze() {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	pg.signalAll(syscall.SIGSTOP)
}

// Thaw continues a frozen server.
func (pg *ownPostgres) Thaw() {
	pg.mu.Lock()
	defer pg.mu.Unlock()
	pg.signalAll(syscall.SIGCONT)
}

// signalAll signals the postmaster first (so it forks no new backend), then
// its children; pg.mu is held. A SIGSTOP takes hold when the postmaster next
// leaves the kernel, so a fork in progress may still finish: the children
// are listed once it is seen stopped, or a backend forked in that moment
// would go on answering (seen on a busy machine: a write committed in 19 ms
// while "frozen").
func (pg *ownPostgres) signalAll(sig syscall.Signal) {
	pid := pg.proc.cmd.Process.Pid
	syscall.Kill(pid, sig)
	if sig == syscall.SIGSTOP {
		waitFor(pg.t, 5*time.Second, "the postmaster to stop", func() bool {
			f := procStat(pid)
			return f == nil || f[0] == "T"
		})
	}
	for _, child := range childPIDs(pid) {
		syscall.Kill(child, sig)
	}
}

// childPIDs lists the processes whose parent is pid, from /proc.
func childPIDs(pid int) []int {
	entries, _ := os.ReadDir("/proc")
	var children []int
	for _, e := range entries {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if fields := procStat(child); len(fields) > 1 && fields[1] == strconv.Itoa(pid) {
			children = append(children, child)
		}
	}
	return children
}

// procStat is /proc/pid/stat after the command: field i of proc(5), 1-based,
// is at i-3 (state, ppid, …). nil when the process is gone. The command may
// hold spaces and parentheses, so the split is after its last ')'.
func procStat(pid int) []string {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	return strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
}

// ---------------------------------------------------------------------------
// Toxiproxy

// testToxiproxy starts a toxiproxy-server for t and returns its client.
func testToxiproxy(t testing.TB) *toxiproxy.Client {
	t.Helper()
	bin, err := findGoTool("toxiproxy-server", "toxiproxy-server binary (fault injection)",
		"scripts/install-deps.sh (go install github.com/Shopify/toxiproxy/v2/cmd/server@v2.5.0, renamed toxiproxy-server)")
	if err != nil {
		failOrSkip(t, err)
	}
	logPath := filepath.Join(t.TempDir(), "toxiproxy.log")
	for attempt := 1; ; attempt++ {
		addr := freeTCPAddr(t)
		host, port, _ := net.SplitHostPort(addr)
		proc, err := startChild(exec.Command(bin, "-host", host, "-port", port), logPath)
		if err != nil {
			t.Fatalf("test services: %v", err)
		}
		t.Cleanup(func() { proc.stop(syscall.SIGTERM, 5*time.Second) })
		client := toxiproxy.NewClient(addr)
		err = proc.waitReady(func(ctx context.Context) error { _, err := client.Proxies(); return err })
		if err == nil {
			return client
		}
		if !proc.portTaken() || attempt == portAttempts {
			t.Fatalf("test services: starting toxiproxy: %v", err)
		}
	}
}

// proxyTo puts a proxy in front of upstream (host:port) and returns it; its
// Listen address is what the service is given instead of upstream.
func proxyTo(t testing.TB, tp *toxiproxy.Client, name, upstream string) *toxiproxy.Proxy {
	t.Helper()
	for attempt := 1; ; attempt++ {
		p, err := tp.CreateProxy(name, freeTCPAddr(t), upstream)
		if err == nil {
			return p
		}
		if attempt == portAttempts {
			t.Fatalf("test services: creating proxy %s to %s: %v", name, upstream, err)
		}
	}
}

// blackHole makes the proxy swallow everything in both directions without
// closing a connection (Toxiproxy's timeout toxic with timeout 0): a
// dependency behind a partition. The returned func removes it.
func blackHole(t testing.TB, p *toxiproxy.Proxy) (restore func()) {
	t.Helper()
	for _, stream := range []string{"upstream", "downstream"} {
		if _, err := p.AddToxic("blackhole-"+stream, "timeout", stream, 1, toxiproxy.Attributes{"timeout": 0}); err != nil {
			t.Fatalf("adding a black hole to %s: %v", p.Name, err)
		}
	}
	return func() {
		for _, stream := range []string{"upstream", "downstream"} {
			if err := removeToxic(p, "blackhole-"+stream); err != nil {
				t.Errorf("removing the black hole of %s: %v", p.Name, err)
			}
		}
	}
}

// removeToxic removes a toxic, trying again when Toxiproxy's API does not
// answer (an EOF on a reused connection was seen on a busy machine, and the
// black hole stayed): a DELETE is idempotent, and a toxic a try already
// removed is reported "not found" to the next.
func removeToxic(p *toxiproxy.Proxy, name string) error {
	var err error
	for try := range 3 {
		if err = p.RemoveToxic(name); err == nil || (try > 0 && strings.Contains(err.Error(), "not found")) {
			return nil
		}
	}
	return err
}

// withHost returns rawURL with its host:port replaced by addr.
func withHost(t testing.TB, rawURL, addr string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("parsing %q: %v", rawURL, err)
	}
	u.Host = addr
	return u.String()
}
