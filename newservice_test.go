package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// scripts/new-service.sh turns a copy of the repository into another service:
// it refuses a dirty tree and a bad NAME, renames everything, and the copy then
// builds, vets, says its new name, mentions kumiko nowhere and passes its own
// boot-to-ready + SIGTERM + exit 0 test against real services. It removes
// itself and this test from the copy, so no file there may mention kumiko.
func TestNewServiceScriptRenamesACopy(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and tests a renamed copy of the repository")
	}
	// Most of its minute is the go command compiling the copy: in parallel,
	// the other tests' waits overlap it.
	t.Parallel()
	const module, name = "example.com/acme/orders-svc", "orders-svc"
	// Services for the copy's own test: started here, handed over by URL so the
	// copy does not start a second PostgreSQL.
	pg, err := sharedPostgres()
	if err != nil {
		failOrSkip(t, err)
	}
	rdb := testRedis(t)

	dir := copyRepo(t)
	git := func(args ...string) {
		t.Helper()
		cmd := exec.Command("git", append([]string{"-c", "user.name=test", "-c", "user.email=test@example.com"}, args...)...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	script := func(args ...string) (string, error) {
		cmd := exec.Command("bash", append([]string{"scripts/new-service.sh"}, args...)...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	refuses := func(why, want string, args ...string) {
		t.Helper()
		out, err := script(args...)
		if err == nil || !strings.Contains(out, want) {
			t.Fatalf("%s: new-service.sh %v = %v, want a refusal saying %q; output:\n%s", why, args, err, want, out)
		}
	}

	git("init", "-q")
	git("add", "-A")
	refuses("uncommitted files", "uncommitted changes", module, name)
	git("commit", "-q", "-m", "template")
	refuses("uppercase NAME", "NAME Orders", module, "Orders")
	refuses("NAME with an underscore", "NAME orders_svc", module, "orders_svc")
	refuses("MODULE without a domain", "MODULE orders", "orders", name)
	refuses("one argument", "usage", name)

	out, err := script(module, name)
	if err != nil {
		t.Fatalf("new-service.sh: %v\n%s", err, out)
	}
	t.Logf("new-service.sh:\n%s", out)
	git("add", "-A")
	git("commit", "-q", "-m", "renamed")
	// The script removed itself; someone running a kept copy of it on the
	// renamed tree is told so, and nothing changes.
	if err := copyFile("scripts/new-service.sh", filepath.Join(dir, "scripts/new-service.sh"), 0o755); err != nil {
		t.Fatal(err)
	}
	refuses("a second run", "already renamed", module, "billing")
	if err := os.Remove(filepath.Join(dir, "scripts/new-service.sh")); err != nil {
		t.Fatal(err)
	}

	// No file of the copy mentions the template, in any case: the script
	// removed itself, this test and the README's template section.
	var mentions []string
	filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			t.Errorf("walking the copy: %v", err)
			return err
		}
		if d.IsDir() && d.Name() == ".git" {
			return filepath.SkipDir
		}
		rel, _ := filepath.Rel(dir, path)
		if strings.Contains(strings.ToLower(rel), "kumiko") {
			mentions = append(mentions, rel+" (file name)")
		}
		if d.IsDir() {
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil {
			t.Errorf("reading %s: %v", rel, err)
			return nil
		}
		if bytes.Contains(bytes.ToLower(data), []byte("kumiko")) {
			mentions = append(mentions, rel)
		}
		return nil
	})
	if len(mentions) > 0 {
		t.Errorf("files of the renamed copy still mentioning kumiko:\n%s", strings.Join(mentions, "\n"))
	}
	// The template's picture of its dashboard is not the copy's: the copy
	// gets none, nor the script that made it, nor the README's line.
	for _, f := range []string{"docs/dashboard.png", "scripts/dashboard-png.sh"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !os.IsNotExist(err) {
			t.Errorf("%s is still in the copy (stat: %v)", f, err)
		}
	}
	if data, err := os.ReadFile(filepath.Join(dir, "README.md")); err != nil || bytes.Contains(data, []byte("dashboard.png")) {
		t.Errorf("the copy's README: %v; still shows docs/dashboard.png", err)
	}
	if data, err := os.ReadFile(filepath.Join(dir, "go.mod")); err != nil || !strings.HasPrefix(string(data), "module "+module+"\n") {
		t.Errorf("go.mod of the copy: %v\n%.200s", err, data)
	}
	copyIsItsOwn(t, dir, name)

	// In the copy, offline (the module cache is shared): vet ./..., gofmt, the
	// copy's own boot-to-ready + SIGTERM drain + exit 0 test (it also reads the
	// renamed metrics and env names), and the binary says its new name. The
	// build comes last: it reuses what the test compiled, and this order keeps
	// the test near 30 s on a loaded machine.
	goCmd := goInCopy(t, dir, pg.adminURL, rdb.URL, "ORDERS_SVC_")
	goCmd(3*time.Minute, "vet", "./...")
	gofmtCmd := exec.Command("gofmt", "-l", ".")
	gofmtCmd.Dir = dir
	if out, err := gofmtCmd.CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("gofmt -l in the copy: %v\n%s", err, out)
	}
	// TestBootAndDrainNamesAreTheDocs holds the copy's own README's drain
	// walk-through to the copy's drain.
	const bootTest, docsTest = "TestProcessSIGTERMDrain", "TestBootAndDrainNamesAreTheDocs"
	testOut := goCmd(5*time.Minute, "test", "-count=1", "-v", "-run", "^("+bootTest+"|"+docsTest+")$", ".")
	for _, test := range []string{bootTest, docsTest} {
		if !strings.Contains(testOut, "--- PASS: "+test) {
			t.Errorf("the copy's %s did not pass:\n%s", test, testOut)
		}
	}
	bin := filepath.Join(t.TempDir(), name)
	goCmd(3*time.Minute, "build", "-o", bin, ".")
	version, err := exec.Command(bin, "version").CombinedOutput()
	if err != nil || !strings.HasPrefix(string(version), name+" ") {
		t.Errorf("%s version = %q, %v; want it to start with %q", name, version, err, name+" ")
	}
	t.Run("shares one Redis and one PostgreSQL with the template", func(t *testing.T) {
		servicesSideBySide(t, bin, "ORDERS_SVC_", "orders-svc:")
	})
}

// servicesSideBySide runs this service and a renamed copy of it (bin, whose
// settings start with envPrefix and whose Redis keys with keyPrefix) against
// one Redis and one PostgreSQL server at once. Each must lead, tick and
// deliver on its own: with a Redis key shared between them (a leader lock,
// an events channel) one of them would never lead, or would deliver the
// other's events to its streams.
func servicesSideBySide(t *testing.T, bin, envPrefix, keyPrefix string) {
	template := leaderEnv(t)
	copyEnv := map[string]string{}
	for k, v := range leaderEnv(t) { // a database of its own, the same Redis
		copyEnv[strings.Replace(k, "KUMIKO_", envPrefix, 1)] = v
	}
	copyEnv["REDIS_URL"] = template["REDIS_URL"]
	rdb := redisClient(t, template["REDIS_URL"])
	events := rdb.Subscribe(context.Background(), eventsChannel, keyPrefix+"events")
	t.Cleanup(func() { events.Close() })
	if _, err := events.Receive(context.Background()); err != nil {
		t.Fatalf("subscribing to both event channels: %v", err)
	}

	procs := map[string]*proc{"template": startProc(t, template), "copy": startBinary(t, bin, copyEnv)}
	envs := map[string]map[string]string{"template": template, "copy": copyEnv}
	channels := map[string]string{"template": eventsChannel, "copy": keyPrefix + "events"}
	for name, p := range procs {
		becameLeader(p, 15*time.Second) // both lead at once: no shared lock
		pool := sharedPool(t, envs[name])
		waitFor(t, 15*time.Second, name+" to enqueue and run two cron ticks", func() bool {
			var done int
			pool.QueryRow(context.Background(), `SELECT count(*) FROM river_job WHERE kind = 'purgeOutbox' AND state = 'completed'`).Scan(&done)
			return done >= 2
		})
		_, api := p.waitReady()
		resp, err := http.Post(api+"/api/orders", "application/json",
			strings.NewReader(`{"customer":"`+name+`","items":[{"sku":"tea","qty":1,"priceCents":250}]}`))
		if err != nil {
			t.Fatalf("%s: posting an order: %v", name, err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("%s: POST /api/orders = %d, want 201", name, resp.StatusCode)
		}
		// Its delivery is published on its own channel, and only there
		// (the services post in turn, so the first order.created is this one).
		for deadline := time.After(10 * time.Second); ; {
			var msg *redis.Message
			select {
			case msg = <-events.Channel():
			case <-deadline:
				t.Fatalf("%s: no order.created published on %s within 10s", name, channels[name])
			}
			if !strings.Contains(msg.Payload, `"type":"order.created"`) {
				continue
			}
			if msg.Channel != channels[name] {
				t.Fatalf("%s's order: published on %s, want %s: %s", name, msg.Channel, channels[name], msg.Payload)
			}
			break
		}
	}
	for _, key := range []string{leaderKey, keyPrefix + "leader"} {
		if n, err := rdb.Exists(context.Background(), key).Result(); err != nil || n != 1 {
			t.Errorf("leader key %s: exists = %d, %v; want both services holding their own lock", key, n, err)
		}
	}
}

// copyRepo copies the repository's files (tracked, plus untracked ones git does
// not ignore: what the next commit would hold) into a new temp dir.
func copyRepo(t *testing.T) string {
	t.Helper()
	out, err := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	dir := t.TempDir()
	for _, rel := range strings.Split(strings.TrimRight(string(out), "\x00"), "\x00") {
		info, err := os.Lstat(rel)
		if os.IsNotExist(err) {
			continue // deleted in the work tree, not yet in the index
		}
		if err != nil || !info.Mode().IsRegular() {
			t.Fatalf("copying %s: %v (mode %v)", rel, err, info.Mode())
		}
		if err := copyFile(rel, filepath.Join(dir, rel), info.Mode().Perm()); err != nil {
			t.Fatalf("copying %s: %v", rel, err)
		}
	}
	return dir
}

func copyFile(from, to string, perm os.FileMode) error {
	if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
		return err
	}
	src, err := os.Open(from)
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return err
	}
	return dst.Close()
}

// goInCopy runs the go command in a copy, offline (the module cache is
// shared), with the test services handed over by URL so the copy does not
// start a second PostgreSQL.
func goInCopy(t *testing.T, dir, pgAdminURL, redisURL, envPrefix string) func(timeout time.Duration, args ...string) string {
	return func(timeout time.Duration, args ...string) string {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOPROXY=off", "GOFLAGS=-mod=readonly",
			"TEST_DATABASE_URL="+pgAdminURL, "TEST_REDIS_URL="+redisURL, envPrefix+"REQUIRE_SERVICES=1")
		start := time.Now()
		out, err := cmd.CombinedOutput()
		t.Logf("go %v in the copy: %s", args, time.Since(start).Round(time.Millisecond))
		if ctx.Err() != nil {
			t.Fatalf("go %v in the copy: still running after %s\n%s", args, timeout, out)
		}
		if err != nil {
			t.Fatalf("go %v in the copy: %v\n%s", args, err, out)
		}
		return string(out)
	}
}

// scripts/new-service.sh --bare leaves the lifecycle without the orders
// demo: no orders files, table, routes, jobs, settings or dashboard feed, no
// word of it in any file, and migrations numbered without its gaps. The copy
// builds, vets, is gofmt-clean, and its binary boots and answers 404 where the
// orders were. Its whole own suite and its scripts/demo.sh run in
// scripts/bare-smoke.sh, a CI stage of its own: minutes this suite would pay
// on every run.
func TestNewServiceScriptBare(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a bare copy of the repository")
	}
	t.Parallel() // as TestNewServiceScriptRenamesACopy
	const module, name = "example.com/acme/billing", "billing"
	dir := copyRepo(t)
	for _, args := range [][]string{{"init", "-q"}, {"add", "-A"}, {"-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-q", "-m", "template"}} {
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	script := exec.Command("bash", "scripts/new-service.sh", module, name, "--bare")
	script.Dir = dir
	if out, err := script.CombinedOutput(); err != nil {
		t.Fatalf("new-service.sh --bare: %v\n%s", err, out)
	}

	// What the demo was is gone: its files, its line, its marked blocks.
	for _, f := range []string{"orders.go", "orders_jobs.go", "orders_search.go", "orders_test.go", "scripts/bench-orders.sh",
		"migrations/000013_orders_public_id.up.sql", "migrations/000001_orders_and_outbox.up.sql"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !os.IsNotExist(err) {
			t.Errorf("%s is still in the bare copy (stat: %v)", f, err)
		}
	}
	for f, gone := range map[string]string{"features.go": "ordersFeature", "migrations/000001_outbox.up.sql": "CREATE TABLE orders",
		"dashboard.html": "order.created", "scripts/demo.sh": "/api/orders", "docs/configuration.md": "REPORT_CRON"} {
		if data, err := os.ReadFile(filepath.Join(dir, f)); err != nil || bytes.Contains(data, []byte(gone)) {
			t.Errorf("%s of the bare copy: %v; still holds %q", f, err, gone)
		}
	}
	copyIsItsOwn(t, dir, name)
	if data, err := os.ReadFile(filepath.Join(dir, "go.mod")); err != nil || bytes.Contains(data, []byte("chromedp")) {
		t.Errorf("go.mod of the bare copy: %v; still requires chromedp, which only the demo's browser test used:\n%s", err, data)
	}
	if hits := demoLeftovers(t, dir); len(hits) > 0 {
		t.Errorf("the bare copy still names the orders demo (mark the lines with demo:begin/demo:end, or say it generically):\n%s",
			strings.Join(hits, "\n"))
	}
	// A new service has no database that remembers the template's numbers:
	// its migrations are 1, 2, 3, … without the demo's gaps.
	ups, _ := filepath.Glob(filepath.Join(dir, "migrations", "*.up.sql"))
	for i, up := range ups {
		base := filepath.Base(up)
		if want := fmt.Sprintf("%06d_", i+1); !strings.HasPrefix(base, want) {
			t.Errorf("migration %s: want it numbered %s (no gap)", base, want)
		}
		if _, err := os.Stat(strings.TrimSuffix(up, ".up.sql") + ".down.sql"); err != nil {
			t.Errorf("migration %s has no down file: %v", base, err)
		}
	}
	if len(ups) == 0 || filepath.Base(ups[0]) != "000001_outbox.up.sql" {
		t.Errorf("the bare copy's first migration: %v, want 000001_outbox.up.sql", ups)
	}

	goCmd := goInCopy(t, dir, "", "", "BILLING_")
	goCmd(3*time.Minute, "vet", "./...")
	// Every function the copy keeps is one it runs.
	switch dc, err := findGoTool("deadcode", "deadcode binary", "scripts/install-deps.sh (go install golang.org/x/tools/cmd/deadcode@v0.52.0)"); {
	case err != nil && os.Getenv("KUMIKO_REQUIRE_SERVICES") == "1":
		t.Error(err)
	case err != nil:
		t.Logf("not looked for unreachable functions: %v", err) // the rest of the copy is still worth testing
	default:
		cmd := exec.Command(dc, ".")
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
			t.Errorf("deadcode in the bare copy: %v\n%s", err, out)
		}
	}
	gofmtCmd := exec.Command("gofmt", "-l", ".")
	gofmtCmd.Dir = dir
	if out, err := gofmtCmd.CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("gofmt -l in the bare copy: %v\n%s", err, out)
	}

	// Its binary boots to ready, serves the lifecycle and no orders.
	bin := filepath.Join(t.TempDir(), name)
	goCmd(3*time.Minute, "build", "-o", bin, ".")
	env := fastEnv(t)
	bareEnv := map[string]string{}
	for k, v := range env {
		bareEnv[strings.Replace(k, "KUMIKO_", "BILLING_", 1)] = v
	}
	delete(bareEnv, "BILLING_MASTER_KEY") // no feature of a bare copy uses one
	// Nor search or file storage: configured or not, neither is connected to.
	bareEnv["MEILI_URL"], bareEnv["S3_ENDPOINT"] = "http://"+freeTCPAddr(t), freeTCPAddr(t)
	bareEnv["S3_ACCESS_KEY"], bareEnv["S3_SECRET_KEY"] = "unused", "unused-secret"
	p := startBinary(t, bin, bareEnv)
	_, api := p.waitReady()
	for phase, note := range map[string]string{"searchAdapter": "no feature uses search", "fileStorage": "no feature uses file storage"} {
		if len(p.logsMatching(map[string]any{"msg": "lifecycle", "phase": phase, "outcome": "skipped", "note": note})) != 1 {
			t.Errorf("phase %s of the bare copy: want it skipped, %q", phase, note)
		}
	}
	for path, want := range map[string]int{"/api/orders": http.StatusNotFound, "/api/slow?ms=1": http.StatusOK} {
		resp, err := http.Get(api + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("the bare service: GET %s = %d, want %d", path, resp.StatusCode, want)
		}
	}
}

// copyIsItsOwn checks what makes the copy in dir read as service name, not
// as the template: a README of its own, no word of the script that made it,
// none of the template's history or pictures and no Markdown link to them
// (or to anything else not in the copy), and a tidy go.mod.
func copyIsItsOwn(t *testing.T, dir, name string) {
	t.Helper()
	readme, err := os.ReadFile(filepath.Join(dir, "README.md"))
	if first, _, _ := strings.Cut(string(readme), "\n"); err != nil || first != "# "+name {
		t.Errorf("the copy's README.md: %v; first line %q, want %q", err, first, "# "+name)
	}
	for _, f := range []string{"docs/measurements.md", "docs/dashboard.png"} {
		if _, err := os.Stat(filepath.Join(dir, f)); !os.IsNotExist(err) {
			t.Errorf("%s is still in the copy (stat: %v)", f, err)
		}
	}
	link := regexp.MustCompile(`\]\(([^)#\s]+)(#[^)\s]*)?\)`)
	var mentions, dangling []string
	err = filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == ".git" {
			return filepath.SkipDir
		}
		if d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(dir, path)
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for i, line := range strings.Split(string(data), "\n") {
			if strings.Contains(line, "new-service") {
				mentions = append(mentions, fmt.Sprintf("%s:%d: %.160s", rel, i+1, strings.TrimSpace(line)))
			}
			if filepath.Ext(path) != ".md" {
				continue
			}
			for _, m := range link.FindAllStringSubmatch(line, -1) {
				if strings.Contains(m[1], "://") || strings.HasPrefix(m[1], "mailto:") {
					continue
				}
				if _, err := os.Stat(filepath.Join(filepath.Dir(path), m[1])); err != nil {
					dangling = append(dangling, fmt.Sprintf("%s:%d: %s", rel, i+1, m[1]))
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("reading the copy: %v", err)
	}
	if len(mentions) > 0 {
		t.Errorf("the copy still names the script that made it:\n%s", strings.Join(mentions, "\n"))
	}
	if len(dangling) > 0 {
		t.Errorf("links in the copy to files it does not have:\n%s", strings.Join(dangling, "\n"))
	}
	// Offline: the script's tidy put what it read in the module cache.
	tidy := exec.Command("go", "mod", "tidy", "-diff")
	tidy.Dir = dir
	tidy.Env = append(os.Environ(), "GOPROXY=off", "GOFLAGS=-mod=mod")
	if out, err := tidy.CombinedOutput(); err != nil || len(out) > 0 {
		t.Errorf("go mod tidy -diff in the copy: %v; go.mod or go.sum is not tidy:\n%s", err, out)
	}
}

// demoWords is what only the orders demo says; a bare copy says none of it,
// in any file. Plain English stays ("in order", "the order of the phases").
var demoWords = regexp.MustCompile(`(?i)\borders\b|\ban order\b|\border(s|ed)?[ _.-]?(id|ids|created|events?|table|insert|statement|path|routes?|feed)\b|` +
	`receipt|report[ _]?(cron|ticks?|jobs?)\b|jobs/report|idempotency|customer|read ?token|pricecents|totalcents|itemcount|` +
	`indexorder|ordersfeature|bench-(orders|sse|overload)|sseload|refhandler|scripts/overload|\bsku\b|demo:(begin|end)`)

// demoLeftovers names, as file:line: text, every line of the copy in dir that
// says a demo word, and every file whose name does.
func demoLeftovers(t *testing.T, dir string) []string {
	t.Helper()
	var hits []string
	err := filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == ".git" {
			return filepath.SkipDir
		}
		rel, _ := filepath.Rel(dir, path)
		if demoWords.MatchString(rel) {
			hits = append(hits, rel+" (its name)")
		}
		if d.IsDir() {
			return nil
		}
		data, err := os.ReadFile(path)
		if err != nil || bytes.IndexByte(data, 0) >= 0 { // binary: the screenshot
			return err
		}
		for i, line := range strings.Split(string(data), "\n") {
			if demoWords.MatchString(line) {
				hits = append(hits, fmt.Sprintf("%s:%d: %.160s", rel, i+1, strings.TrimSpace(line)))
			}
		}
		return nil
	})
	if err != nil {
		t.Fatalf("reading the copy: %v", err)
	}
	return hits
}
