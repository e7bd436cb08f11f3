package main

// Test helpers that give tests real backing services: a shared throwaway
// PostgreSQL server (one database per test), a redis-server per test and a
// versitygw S3 gateway per test. Servers are started from the binaries on the
// machine, listen only on 127.0.0.1, and are killed when the test (or, for
// PostgreSQL, the test binary) finishes.
//
// Environment:
//
//	TEST_DATABASE_URL         use this PostgreSQL server instead of starting one
//	                          (URL form; a fresh database is still created per call)
//	TEST_REDIS_URL            use this Redis instead of starting one (FLUSHALLed per call)
//	KUMIKO_REQUIRE_SERVICES=1 a missing server binary fails the test instead of skipping it

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"go/build"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/redis/go-redis/v9"
)

const (
	// serviceStartTimeout bounds how long a server may take to accept
	// connections; generous because CI machines can be slow and loaded.
	serviceStartTimeout = 60 * time.Second
	// portAttempts is how often a server start is retried on a new port when
	// another process grabbed the "free" port between probe and bind.
	portAttempts = 3
)

// ---------------------------------------------------------------------------
// Missing binaries: skip, or fail under KUMIKO_REQUIRE_SERVICES=1.

// missingServiceError reports that a server binary (or the account it must
// run as) is not available on this machine.
type missingServiceError struct {
	what    string // e.g. "redis-server binary"
	install string // how to get it
}

func (e *missingServiceError) Error() string {
	return fmt.Sprintf("%s not found; install it with: %s", e.what, e.install)
}

// failOrSkip ends the test because a service is unavailable. A missing binary
// is a skip unless KUMIKO_REQUIRE_SERVICES=1 (CI), where silently skipping
// would hide that nothing was tested; every other error is a failure.
func failOrSkip(t testing.TB, err error) {
	t.Helper()
	var missing *missingServiceError
	switch {
	case !errors.As(err, &missing):
		t.Fatalf("test services: %v", err)
	case os.Getenv("KUMIKO_REQUIRE_SERVICES") == "1":
		t.Fatalf("test services: %v (KUMIKO_REQUIRE_SERVICES=1 makes this a failure)", err)
	default:
		t.Skipf("test services: %v (set KUMIKO_REQUIRE_SERVICES=1 to fail instead of skip)", err)
	}
}

// ---------------------------------------------------------------------------
// Ports and child processes.

// freeTCPAddr returns "127.0.0.1:PORT" of a port that was free a moment ago.
func freeTCPAddr(t testing.TB) string {
	t.Helper()
	addr, err := pickFreeTCPAddr()
	if err != nil {
		t.Fatalf("test services: %v", err)
	}
	return addr
}

func pickFreeTCPAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("finding a free loopback port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// childProcess is a server process started and reaped by this package.
type childProcess struct {
	cmd     *exec.Cmd
	logPath string
	done    chan struct{} // closed once the process has exited and been reaped
	waitErr error         // result of cmd.Wait, valid after done is closed
}

// startChild starts cmd with stdout and stderr appended to logPath. The child
// gets SIGKILL when the thread that started it dies, so a crashed or killed
// test binary cannot leak servers (go.dev/issue/27505: Go only ends threads
// of goroutines that exit while locked to their thread, which tests don't do).
func startChild(cmd *exec.Cmd, logPath string) (*childProcess, error) {
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("opening server log: %w", err)
	}
	// The child inherits its own copy of the descriptor.
	defer logFile.Close()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", cmd.Path, err)
	}
	p := &childProcess{cmd: cmd, logPath: logPath, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

// stop sends sig, waits up to grace for the exit, then SIGKILLs and waits.
// It is a no-op once the process has exited.
func (p *childProcess) stop(sig syscall.Signal, grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// kill SIGKILLs the process and waits until it has been reaped.
func (p *childProcess) kill() { p.stop(syscall.SIGKILL, 0) }

// waitReady polls ready until it succeeds, the process exits or the start
// timeout passes. Errors include the tail of the server log.
func (p *childProcess) waitReady(ready func(context.Context) error) error {
	deadline := time.Now().Add(serviceStartTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := ready(ctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited before it was ready (%v); log %s:\n%s",
				filepath.Base(p.cmd.Path), p.waitErr, p.logPath, logTail(p.logPath))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			p.kill()
			return fmt.Errorf("%s not ready after %v (last error: %w); log %s:\n%s",
				filepath.Base(p.cmd.Path), serviceStartTimeout, err, p.logPath, logTail(p.logPath))
		}
	}
}

// portTaken reports whether the server failed because its port was grabbed
// between pickFreeTCPAddr and the server's bind; such starts are retried.
func (p *childProcess) portTaken() bool {
	b, _ := os.ReadFile(p.logPath)
	return bytes.Contains(bytes.ToLower(b), []byte("address already in use"))
}

// logTail returns the last few KiB of a server log for failure messages.
func logTail(path string) string {
	const max = 4 << 10
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	if len(b) > max {
		b = append([]byte("..."), b[len(b)-max:]...)
	}
	return string(b)
}

// dialable reports whether something accepts TCP connections on addr.
func dialable(ctx context.Context, addr string) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	return conn.Close()
}

// ---------------------------------------------------------------------------
// PostgreSQL.

// sharedPG is the shared PostgreSQL server of this test process. It is the
// only package-level mutable state: creating a cluster takes about a second,
// too slow to do per test, so the first testPostgres call starts it and every
// test gets its own database on it. mu serialises that lazy start (parallel
// callers wait for it) against stopTestServices.
var sharedPG struct {
	mu      sync.Mutex
	started bool      // a start was attempted; err holds its failure
	srv     *pgServer // nil unless started successfully
	err     error
	dbSeq   atomic.Uint64 // numbers the databases, for readable names
}

// pgServer is a PostgreSQL server that testPostgres creates databases on.
type pgServer struct {
	adminURL string        // superuser URL of the "postgres" maintenance database
	createDB string        // CREATE DATABASE options, see createDatabaseOptions
	proc     *childProcess // nil for an external server (TEST_DATABASE_URL)
	baseDir  string        // holds data dir, socket dir and log; removed on stop
}

// testPostgres returns the URL of a fresh, empty database on the shared
// PostgreSQL server and drops the database (WITH (FORCE)) when t finishes.
func testPostgres(t testing.TB) string {
	t.Helper()
	srv, err := sharedPostgres()
	if err != nil {
		failOrSkip(t, err)
	}
	name, err := newDatabaseName()
	if err != nil {
		t.Fatalf("test services: %v", err)
	}
	dbURL, err := withDatabase(srv.adminURL, name)
	if err != nil {
		t.Fatalf("test services: %v", err)
	}
	if err := pgAdminExec(srv.adminURL, "CREATE DATABASE "+name+" "+srv.createDB); err != nil {
		t.Fatalf("test services: creating database %s: %v", name, err)
	}
	t.Cleanup(func() {
		// FORCE ends connections a test leaked, so the drop cannot hang.
		if err := pgAdminExec(srv.adminURL, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("test services: dropping database %s: %v", name, err)
		}
	})
	return dbURL
}

// newDatabaseName returns a name unique within this process (sequence) and
// across processes sharing a TEST_DATABASE_URL server (random suffix; PIDs
// repeat across CI containers).
func newDatabaseName() (string, error) {
	var suffix [4]byte
	if _, err := rand.Read(suffix[:]); err != nil {
		return "", fmt.Errorf("generating database name: %w", err)
	}
	return fmt.Sprintf("kumiko_test_%d_%x", sharedPG.dbSeq.Add(1), suffix), nil
}

// sharedPostgres returns the shared server, starting it on first use.
func sharedPostgres() (*pgServer, error) {
	sharedPG.mu.Lock()
	defer sharedPG.mu.Unlock()
	if !sharedPG.started {
		sharedPG.started = true
		sharedPG.srv, sharedPG.err = startPostgres()
		if sharedPG.err == nil {
			sharedPG.srv.createDB, sharedPG.err = createDatabaseOptions(sharedPG.srv.adminURL)
		}
	}
	return sharedPG.srv, sharedPG.err
}

// createDatabaseOptions picks the fastest way to create an empty database on
// the server; connecting also proves a TEST_DATABASE_URL server is reachable.
//
// template0 is guaranteed empty and never has connections, so parallel
// CREATE DATABASEs don't fail with "source database is being accessed".
// From PostgreSQL 15 on, the default WAL_LOG strategy writes the whole 7 MB
// template through the WAL; FILE_COPY copies the files and is about twice as
// fast (15 vs 30 ms on tmpfs here), at the cost of checkpoints, which are
// cheap with fsync=off.
func createDatabaseOptions(adminURL string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return "", fmt.Errorf("connecting to postgres: %w", err)
	}
	defer conn.Close(ctx)
	var version int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&version); err != nil {
		return "", fmt.Errorf("querying postgres version: %w", err)
	}
	if version >= 150000 {
		return "TEMPLATE template0 STRATEGY FILE_COPY", nil
	}
	return "TEMPLATE template0", nil
}

// stopTestServices stops the shared PostgreSQL server and removes its data
// directory. TestMain calls it after m.Run; it is a no-op if nothing started.
func stopTestServices() {
	sharedPG.mu.Lock()
	defer sharedPG.mu.Unlock()
	if srv := sharedPG.srv; srv != nil && srv.proc != nil {
		// SIGQUIT is what "pg_ctl stop -m immediate" sends: no checkpoint,
		// the data is thrown away anyway.
		srv.proc.stop(syscall.SIGQUIT, 10*time.Second)
		_ = os.RemoveAll(srv.baseDir)
	}
	sharedPG.srv, sharedPG.err, sharedPG.started = nil, nil, false
}

// startPostgres returns TEST_DATABASE_URL's server if set, else initialises a
// throwaway cluster and starts it on a free port.
func startPostgres() (*pgServer, error) {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return &pgServer{adminURL: u}, nil
	}
	binDir, err := findPostgresBinDir()
	if err != nil {
		return nil, err
	}
	cred, err := postgresCredential()
	if err != nil {
		return nil, err
	}
	baseDir, err := makePostgresBaseDir(cred)
	if err != nil {
		return nil, err
	}
	srv, err := initAndStartPostgres(binDir, baseDir, cred)
	if err != nil {
		_ = os.RemoveAll(baseDir)
		return nil, err
	}
	return srv, nil
}

func initAndStartPostgres(binDir, baseDir string, cred *syscall.Credential) (*pgServer, error) {
	dataDir := filepath.Join(baseDir, "data")
	sockDir := filepath.Join(baseDir, "sock")
	if err := os.Mkdir(sockDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating postgres socket dir: %w", err)
	}
	if err := chownTo(sockDir, cred); err != nil {
		return nil, err
	}
	// --no-sync: the cluster is thrown away, fsyncing it only costs seconds.
	// C.UTF-8 pins a locale that exists everywhere, independent of LANG.
	initdb := exec.Command(filepath.Join(binDir, "initdb"), "-D", dataDir,
		"-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8", "--locale=C.UTF-8")
	asPostgresUser(initdb, baseDir, cred)
	if out, err := initdb.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("running initdb: %w\n%s", err, out)
	}
	logPath := filepath.Join(baseDir, "postgres.log")
	for attempt := 1; ; attempt++ {
		addr, err := pickFreeTCPAddr()
		if err != nil {
			return nil, err
		}
		srv, proc, err := launchPostgres(binDir, dataDir, sockDir, logPath, addr, cred)
		if err == nil {
			srv.baseDir = baseDir
			return srv, nil
		}
		if proc == nil || !proc.portTaken() || attempt == portAttempts {
			return nil, err
		}
	}
}

// launchPostgres runs the postmaster directly instead of via "pg_ctl start":
// pg_ctl daemonises it, which would make it outlive a killed test binary,
// whereas our own child gets Pdeathsig. Postgres backends notice their
// postmaster's death and exit by themselves.
func launchPostgres(binDir, dataDir, sockDir, logPath, addr string, cred *syscall.Credential) (*pgServer, *childProcess, error) {
	_, port, _ := net.SplitHostPort(addr)
	cmd := exec.Command(filepath.Join(binDir, "postgres"), "-D", dataDir,
		"-p", port, "-k", sockDir,
		"-c", "listen_addresses=127.0.0.1",
		// Durability is pointless for throwaway data and costs test time.
		"-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
		// Parallel tests each open pools; the default 100 runs out.
		"-c", "max_connections=200",
		// Keep dynamic shared memory in the data dir: the default posix
		// segments in /dev/shm outlive an immediate or killed shutdown.
		"-c", "dynamic_shared_memory_type=mmap")
	asPostgresUser(cmd, filepath.Dir(dataDir), cred)
	proc, err := startChild(cmd, logPath)
	if err != nil {
		return nil, nil, fmt.Errorf("starting postgres: %w", err)
	}
	adminURL := "postgres://postgres@" + addr + "/postgres?sslmode=disable"
	if err := proc.waitReady(func(ctx context.Context) error { return pgPing(ctx, adminURL) }); err != nil {
		return nil, proc, fmt.Errorf("starting postgres: %w", err)
	}
	return &pgServer{adminURL: adminURL, proc: proc}, proc, nil
}

func pgPing(ctx context.Context, dbURL string) error {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

// pgAdminExec runs one statement on the server's maintenance database.
func pgAdminExec(adminURL, sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("connecting to postgres: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql); err != nil {
		return fmt.Errorf("executing %q: %w", sql, err)
	}
	return nil
}

// withDatabase returns adminURL pointing at database name instead.
func withDatabase(adminURL, name string) (string, error) {
	u, err := url.Parse(adminURL)
	if err != nil {
		return "", fmt.Errorf("parsing postgres URL: %w", err)
	}
	if u.Scheme != "postgres" && u.Scheme != "postgresql" {
		return "", fmt.Errorf("postgres URL %q: TEST_DATABASE_URL must be a postgres:// URL", u.Redacted())
	}
	u.Path = "/" + name
	u.RawPath = ""
	return u.String(), nil
}

// findPostgresBinDir finds the directory holding initdb and postgres: PATH
// first, then Debian's /usr/lib/postgresql/N/bin and RHEL's /usr/pgsql-N/bin
// (newest version first), where packages install them without touching PATH.
// initdb and postgres must come from the same version, hence one directory.
func findPostgresBinDir() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		if dir := filepath.Dir(p); isExecutable(filepath.Join(dir, "postgres")) {
			return dir, nil
		}
	}
	for _, pattern := range []string{"/usr/lib/postgresql/*/bin", "/usr/pgsql-*/bin"} {
		dirs, _ := filepath.Glob(pattern)
		sort.Slice(dirs, func(i, j int) bool { return pgDirVersion(dirs[i]) > pgDirVersion(dirs[j]) })
		for _, dir := range dirs {
			if isExecutable(filepath.Join(dir, "initdb")) && isExecutable(filepath.Join(dir, "postgres")) {
				return dir, nil
			}
		}
	}
	return "", &missingServiceError{
		what:    "PostgreSQL server binaries (initdb, postgres)",
		install: "apt-get install postgresql (or set TEST_DATABASE_URL)",
	}
}

// pgDirVersion extracts the major version from .../postgresql/15/bin or
// /usr/pgsql-15/bin so that 15 sorts above 9.6.
func pgDirVersion(binDir string) float64 {
	base := filepath.Base(filepath.Dir(binDir))
	v, _ := strconv.ParseFloat(strings.TrimPrefix(base, "pgsql-"), 64)
	return v
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// postgresCredential returns the postgres account to run the server as when
// we are root (postgres refuses to run as root), or nil otherwise.
func postgresCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, &missingServiceError{
			what:    "user \"postgres\" (needed because PostgreSQL refuses to run as root)",
			install: "apt-get install postgresql (or useradd --system postgres)",
		}
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("parsing uid of user postgres: %w", err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("parsing gid of user postgres: %w", err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
}

// asPostgresUser makes cmd run as cred (if non-nil) in dir, because the
// inherited working directory may be unreadable for the postgres user.
func asPostgresUser(cmd *exec.Cmd, dir string, cred *syscall.Credential) {
	cmd.Dir = dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL}
}

// pgDirPrefix names the shared cluster's temp dirs, so that dirs leaked by
// killed test runs can be found again.
const pgDirPrefix = "kumiko-pg-"

// makePostgresBaseDir creates the temp dir for the cluster. When running as
// root it is handed to the postgres user, and its ancestors get the search
// bit so that user can reach it (os.MkdirTemp makes 0700 dirs, and TMPDIR may
// be inside a private home directory).
func makePostgresBaseDir(cred *syscall.Credential) (string, error) {
	root := postgresTempRoot()
	removeStalePostgresDirs(root)
	dir, err := os.MkdirTemp(root, pgDirPrefix)
	if err != nil {
		return "", fmt.Errorf("creating postgres temp dir: %w", err)
	}
	if cred == nil {
		return dir, nil
	}
	if err := chownTo(dir, cred); err != nil {
		_ = os.RemoveAll(dir)
		return "", err
	}
	if err := makeTraversable(filepath.Dir(dir)); err != nil {
		_ = os.RemoveAll(dir)
		return "", err
	}
	return dir, nil
}

// postgresTempRoot prefers /dev/shm for the throwaway cluster: on tmpfs
// CREATE DATABASE takes ~15 ms instead of 300-800 ms on a disk-backed ext4
// (initdb ~1 s instead of ~2.5 s). A small /dev/shm (Docker's default is
// 64 MiB) would fill up, so it is only used with 1 GiB free.
func postgresTempRoot() string {
	const shm, minFree = "/dev/shm", 1 << 30
	var st syscall.Statfs_t
	if err := syscall.Statfs(shm, &st); err != nil || st.Bavail*uint64(st.Bsize) < minFree {
		return os.TempDir()
	}
	if err := syscall.Access(shm, 0o2|0o1); err != nil { // W_OK|X_OK
		return os.TempDir()
	}
	return shm
}

// removeStalePostgresDirs deletes clusters left behind by test binaries that
// were killed before stopTestServices ran (Pdeathsig stopped their server, but
// nothing removed the files, which on /dev/shm occupy RAM). A dir is stale
// when its postmaster is gone, or when it never got one and is older than any
// initdb could take.
func removeStalePostgresDirs(root string) {
	dirs, _ := filepath.Glob(filepath.Join(root, pgDirPrefix+"*"))
	for _, dir := range dirs {
		if postgresDirStale(dir) {
			_ = os.RemoveAll(dir)
		}
	}
}

func postgresDirStale(dir string) bool {
	pidFile, err := os.ReadFile(filepath.Join(dir, "data", "postmaster.pid"))
	if err != nil {
		fi, err := os.Stat(dir)
		return err == nil && time.Since(fi.ModTime()) > 10*time.Minute
	}
	firstLine, _, _ := strings.Cut(string(pidFile), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(firstLine))
	if err != nil || pid <= 0 {
		return false
	}
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}

func chownTo(path string, cred *syscall.Credential) error {
	if cred == nil {
		return nil
	}
	if err := os.Chown(path, int(cred.Uid), int(cred.Gid)); err != nil {
		return fmt.Errorf("handing %s to the postgres user: %w", path, err)
	}
	return nil
}

// makeTraversable adds o+x to dir and its ancestors where missing. Only the
// search bit is added: enough to reach the data dir, listing stays private.
func makeTraversable(dir string) error {
	for {
		fi, err := os.Stat(dir)
		if err != nil {
			return fmt.Errorf("checking access to %s: %w", dir, err)
		}
		if fi.Mode().Perm()&0o001 == 0 {
			if err := os.Chmod(dir, fi.Mode().Perm()|0o001); err != nil {
				return fmt.Errorf("making %s searchable for the postgres user: %w", dir, err)
			}
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return nil
		}
		dir = parent
	}
}

// ---------------------------------------------------------------------------
// Redis.

// testRedisServer is a redis-server owned by one test. Stop and Start let a
// test simulate an outage and recovery on the same address. They must be
// called from the test's goroutine (they may call t.Fatal or t.Skip).
type testRedisServer struct {
	URL  string // redis://127.0.0.1:PORT/0
	Addr string // 127.0.0.1:PORT

	t       testing.TB
	bin     string // empty for an external server (TEST_REDIS_URL)
	dir     string // working dir and log location
	logPath string

	mu   sync.Mutex
	proc *childProcess // nil while stopped
}

// testRedis starts a new redis-server for t and stops it when t finishes.
// With TEST_REDIS_URL set it FLUSHALLs and returns that server instead; Stop
// and Start then skip the test, as an external server cannot be stopped.
func testRedis(t testing.TB) *testRedisServer {
	t.Helper()
	if u := os.Getenv("TEST_REDIS_URL"); u != "" {
		return externalRedis(t, u)
	}
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		failOrSkip(t, &missingServiceError{
			what:    "redis-server binary",
			install: "apt-get install redis-server (or set TEST_REDIS_URL)",
		})
	}
	dir := t.TempDir()
	s := &testRedisServer{t: t, bin: bin, dir: dir, logPath: filepath.Join(dir, "redis.log")}
	// Registered after t.TempDir, so it runs before the directory is removed.
	t.Cleanup(s.Stop)
	for attempt := 1; ; attempt++ {
		s.Addr = freeTCPAddr(t)
		proc, err := s.start()
		if err == nil {
			break
		}
		if proc == nil || !proc.portTaken() || attempt == portAttempts {
			t.Fatalf("test services: %v", err)
		}
		_ = os.Remove(s.logPath)
	}
	s.URL = "redis://" + s.Addr + "/0"
	return s
}

func externalRedis(t testing.TB, rawURL string) *testRedisServer {
	t.Helper()
	opts, err := redis.ParseURL(rawURL)
	if err != nil {
		t.Fatalf("test services: parsing TEST_REDIS_URL: %v", err)
	}
	client := redis.NewClient(opts)
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := client.FlushAll(ctx).Err(); err != nil {
		t.Fatalf("test services: flushing TEST_REDIS_URL server: %v", err)
	}
	return &testRedisServer{URL: rawURL, Addr: opts.Addr, t: t}
}

// Stop kills the server and waits for it to exit. Stopping a stopped server
// does nothing.
func (s *testRedisServer) Stop() {
	if s.bin == "" {
		s.t.Helper()
		s.t.Skip("test services: TEST_REDIS_URL is an external server and cannot be stopped")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		s.proc.kill()
		s.proc = nil
	}
}

// Start restarts a stopped server on the same address and waits until it
// answers PING. Starting a running server does nothing.
func (s *testRedisServer) Start() {
	s.t.Helper()
	if s.bin == "" {
		s.t.Skip("test services: TEST_REDIS_URL is an external server and cannot be restarted")
	}
	if _, err := s.start(); err != nil {
		s.t.Fatalf("test services: restarting redis on %s: %v", s.Addr, err)
	}
}

// start launches the server unless it is running. On failure the returned
// process (if any) has exited and lets the caller inspect its log.
func (s *testRedisServer) start() (*childProcess, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc != nil {
		return s.proc, nil
	}
	host, port, err := net.SplitHostPort(s.Addr)
	if err != nil {
		return nil, fmt.Errorf("parsing redis address: %w", err)
	}
	// No persistence: a restarted server must come back empty, like a
	// crashed cache, and nothing may be written outside the temp dir.
	cmd := exec.Command(s.bin, "--port", port, "--bind", host,
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", s.dir)
	proc, err := startChild(cmd, s.logPath)
	if err != nil {
		return nil, fmt.Errorf("starting redis-server: %w", err)
	}
	if err := proc.waitReady(func(ctx context.Context) error { return redisPing(ctx, s.Addr) }); err != nil {
		proc.kill()
		return proc, fmt.Errorf("starting redis-server: %w", err)
	}
	s.proc = proc
	return proc, nil
}

// redisPing checks the TCP port first so go-redis does not log dial errors
// while the server is still starting.
func redisPing(ctx context.Context, addr string) error {
	if err := dialable(ctx, addr); err != nil {
		return err
	}
	client := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DisableIdentity: true})
	defer client.Close()
	return client.Ping(ctx).Err()
}

// ---------------------------------------------------------------------------
// S3 (versitygw).

// testS3Server is a versitygw S3 gateway serving Dir over plain HTTP.
type testS3Server struct {
	Endpoint  string // host:port, for minio.New with Secure: false
	AccessKey string
	SecretKey string
	Dir       string // posix backend root; buckets are its subdirectories
}

// testS3 starts a versitygw gateway on a temp dir for t and stops it when t
// finishes. It returns once ListBuckets succeeds.
func testS3(t testing.TB) *testS3Server {
	t.Helper()
	bin, err := findVersitygw()
	if err != nil {
		failOrSkip(t, err)
	}
	root := t.TempDir()
	s := &testS3Server{
		AccessKey: "kumiko-test-access",
		SecretKey: "kumiko-test-secret-key",
		Dir:       filepath.Join(root, "data"),
	}
	if err := os.Mkdir(s.Dir, 0o755); err != nil {
		t.Fatalf("test services: creating S3 data dir: %v", err)
	}
	logPath := filepath.Join(root, "versitygw.log")
	for attempt := 1; ; attempt++ {
		s.Endpoint = freeTCPAddr(t)
		proc, err := s.launch(bin, logPath)
		if proc != nil {
			// Registered after t.TempDir, so it runs before root is removed.
			t.Cleanup(func() { proc.stop(syscall.SIGTERM, 5*time.Second) })
		}
		if err == nil {
			return s
		}
		if proc == nil || !proc.portTaken() || attempt == portAttempts {
			t.Fatalf("test services: %v", err)
		}
		_ = os.Remove(logPath)
	}
}

func (s *testS3Server) launch(bin, logPath string) (*childProcess, error) {
	cmd := exec.Command(bin, "--port", s.Endpoint, "posix", s.Dir)
	cmd.Env = append(os.Environ(), "ROOT_ACCESS_KEY="+s.AccessKey, "ROOT_SECRET_KEY="+s.SecretKey)
	proc, err := startChild(cmd, logPath)
	if err != nil {
		return nil, fmt.Errorf("starting versitygw: %w", err)
	}
	if err := proc.waitReady(s.ready); err != nil {
		return proc, fmt.Errorf("starting versitygw: %w", err)
	}
	return proc, nil
}

// ready checks the port first, then that the gateway answers a signed S3
// request, which proves the credentials and the backend work.
func (s *testS3Server) ready(ctx context.Context) error {
	if err := dialable(ctx, s.Endpoint); err != nil {
		return err
	}
	client, err := minio.New(s.Endpoint, &minio.Options{
		Creds: credentials.NewStaticV4(s.AccessKey, s.SecretKey, ""),
	})
	if err != nil {
		return fmt.Errorf("creating S3 client: %w", err)
	}
	_, err = client.ListBuckets(ctx)
	return err
}

// findVersitygw finds the S3 server of the storage tests.
func findVersitygw() (string, error) {
	return findGoTool("versitygw", "versitygw binary (S3 server)", "go install github.com/versity/versitygw/cmd/versitygw@v1.8.0")
}

// findGoTool looks for a server binary on PATH, then in the Go bin
// directories where "go install" (scripts/install-deps.sh) puts it.
func findGoTool(name, what, install string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	var dirs []string
	if gobin := os.Getenv("GOBIN"); gobin != "" {
		dirs = append(dirs, gobin)
	}
	// "go env GOPATH" also honours "go env -w"; build.Default is the fallback.
	if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
		for _, p := range filepath.SplitList(strings.TrimSpace(string(out))) {
			dirs = append(dirs, filepath.Join(p, "bin"))
		}
	}
	for _, p := range filepath.SplitList(build.Default.GOPATH) {
		dirs = append(dirs, filepath.Join(p, "bin"))
	}
	for _, dir := range dirs {
		if p := filepath.Join(dir, name); isExecutable(p) {
			return p, nil
		}
	}
	return "", &missingServiceError{what: what, install: install}
}

// Pause freezes the server (SIGSTOP): connections stay open but nothing is
// answered, like a Redis stuck behind a network partition. Resume undoes it.
func (s *testRedisServer) Pause() { s.signal(syscall.SIGSTOP) }

// Resume continues a paused server (SIGCONT).
func (s *testRedisServer) Resume() { s.signal(syscall.SIGCONT) }

func (s *testRedisServer) signal(sig syscall.Signal) {
	s.t.Helper()
	if s.bin == "" {
		s.t.Skip("test services: TEST_REDIS_URL is an external server and cannot be signalled")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		s.t.Fatalf("test services: redis on %s is not running", s.Addr)
	}
	if err := s.proc.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("test services: signalling redis: %v", err)
	}
}
