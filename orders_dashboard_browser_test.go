package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
)

// headlessChromium starts a headless Chromium for the test and returns its
// context, bounded by timeout.
func headlessChromium(t *testing.T, timeout time.Duration) context.Context {
	t.Helper()
	browser := ""
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			browser = p
			break
		}
	}
	if browser == "" {
		failOrSkip(t, &missingServiceError{what: "chromium", install: "apt-get install chromium"})
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.WindowSize(1280, 1000))
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	browserCtx, cancelBrowser := chromedp.NewContext(allocCtx)
	ctx, cancel := context.WithTimeout(browserCtx, timeout)
	t.Cleanup(func() { cancel(); cancelBrowser(); cancelAlloc() })
	return ctx
}

// waitDOM polls the page until the JavaScript expression is true; on timeout
// it fails with the page's text, which is what a person would have seen.
func waitDOM(t *testing.T, ctx context.Context, within time.Duration, what, expr string) {
	t.Helper()
	deadline := time.Now().Add(within)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool]("!!("+expr+")"))
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			text, _ := chromedp.Run(ctx, chromedp.Evaluate[string]("document.body.innerText"))
			t.Fatalf("the dashboard never showed %s (last error %v); the page said:\n%s", what, err, text)
		}
		<-tick.C
	}
}

// The dashboard in a real headless browser, on one instance: state ready,
// the boot timeline, then an order posted now arrives through the event stream.
func TestDashboardInHeadlessChromium(t *testing.T) {
	ctx := headlessChromium(t, time.Minute)
	s := startInProcess(t, fastEnv(t))
	if _, err := chromedp.Run(ctx, chromedp.Navigate(apiURL(s)+"/")); err != nil {
		t.Fatalf("opening the dashboard: %v", err)
	}
	waitDOM(t, ctx, 20*time.Second, "state ready", `document.querySelector('#state[data-state="ready"]')`)
	waitDOM(t, ctx, 20*time.Second, "a boot timeline with every phase placed in time and the slowest marked",
		fmt.Sprintf(`document.querySelectorAll('[data-instance] .ph').length === %d &&
			document.querySelectorAll('[data-instance] .ph.slowest').length === 1 &&
			[...document.querySelectorAll('[data-instance] .seg')].every((s) => s.style.left !== "")`, len(phaseOrder)))
	code, _, body := post(t, apiURL(s)+"/api/orders", validOrder, nil)
	if code != 201 {
		t.Fatalf("POST %d %v", code, body)
	}
	// The event carries no order id (the stream is public): the order's total, 9.00, tells it.
	waitDOM(t, ctx, 20*time.Second, "the order's order.created event", fmt.Sprintf(`document.querySelector('#events li[data-total="%v"]')`, body["totalCents"]))
}

// testBalancer stands in for the demo's HAProxy: it checks each backend's
// readiness every 50 ms and sends every request to the first backend that
// answered 200, so a draining instance leaves the pool at once.
type testBalancer struct {
	srv   *httptest.Server
	ready []atomic.Bool
}

func startTestBalancer(t *testing.T, backends []struct{ api, ops string }) *testBalancer {
	t.Helper()
	lb := &testBalancer{ready: make([]atomic.Bool, len(backends))}
	proxies := make([]*httputil.ReverseProxy, len(backends))
	for i, b := range backends {
		u, err := url.Parse(b.api)
		if err != nil {
			t.Fatal(err)
		}
		proxies[i] = httputil.NewSingleHostReverseProxy(u)
		proxies[i].FlushInterval = -1 // the event stream passes through unbuffered
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		client := &http.Client{Timeout: 500 * time.Millisecond}
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			for i, b := range backends {
				resp, err := client.Get(b.ops + "/health/ready")
				lb.ready[i].Store(err == nil && resp.StatusCode == http.StatusOK)
				if err == nil {
					resp.Body.Close()
				}
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	lb.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for i := range backends {
			if lb.ready[i].Load() {
				proxies[i].ServeHTTP(w, r)
				return
			}
		}
		http.Error(w, "no backend is ready", http.StatusServiceUnavailable)
	}))
	t.Cleanup(func() {
		close(stop)
		<-done
		lb.srv.CloseClientConnections()
		lb.srv.Close()
	})
	return lb
}

// Two real instances behind a load balancer, the page open on it. SIGTERM
// app1 (the leader, serving the page): the page shows app1 draining, its
// drain steps, then stopped; app2 ready and leader after a hand-over; the
// page now served by app2 and its event stream resumed there, with the
// orders posted before, during and after the drain each shown once.
// KUMIKO_SCREENSHOT=docs/dashboard.png saves the mid-drain screenshot there.
func TestDashboardClusterDrainInHeadlessChromium(t *testing.T) {
	t.Parallel()
	shot := filepath.Join(t.TempDir(), "dashboard.png")
	if path := os.Getenv("KUMIKO_SCREENSHOT"); path != "" {
		shot, _ = filepath.Abs(path)
	}
	ctx := headlessChromium(t, 2*time.Minute)
	env := leaderEnv(t)
	// A fixed linger: the page sees app1 draining (≤ 2 s: poll + cache) with a margin.
	env["KUMIKO_LINGER"], env["KUMIKO_LINGER_QUIET"] = "5s", "5s"
	env["KUMIKO_SHUTDOWN_TIMEOUT"] = "20s"
	app1 := startAs(t, env, "app1")
	ops1, api1 := app1.waitReady()
	becameLeader(app1, bootBudget)
	app2 := startAs(t, env, "app2")
	ops2, api2 := app2.waitReady()
	lb := startTestBalancer(t, []struct{ api, ops string }{{api1, ops1}, {api2, ops2}})
	// Each order has a total of its own: the public event carries no order
	// id, and the total tells the page's lines apart.
	posted := 0
	order := func() string {
		t.Helper()
		posted++
		body := fmt.Sprintf(`{"customer":"Ada","items":[{"sku":"tea","qty":1,"priceCents":%d}]}`, 100+posted)
		code, _, answer := post(t, lb.srv.URL+"/api/orders", body, nil)
		if code != 201 {
			t.Fatalf("POST through the load balancer = %d %v", code, answer)
		}
		return fmt.Sprint(answer["totalCents"])
	}
	card := func(id string) string { return fmt.Sprintf(`document.querySelector('[data-instance=%q]')`, id) }
	orderShown := func(total string) string {
		return fmt.Sprintf(`document.querySelector('#events li[data-total=%q]')`, total)
	}

	if _, err := chromedp.Run(ctx, chromedp.Navigate(lb.srv.URL+"/")); err != nil {
		t.Fatalf("opening the dashboard: %v", err)
	}
	waitDOM(t, ctx, 20*time.Second, "both instances ready, app1 serving the page and leading",
		card("app1")+`?.dataset.state === "ready" && `+card("app2")+`?.dataset.state === "ready" && `+
			card("app1")+`.querySelector(".leader") && document.querySelector("#instance").textContent === "app1" &&
			document.querySelector("#stream").textContent === "connected"`)
	before := order()
	waitDOM(t, ctx, 20*time.Second, "the order posted before the drain", orderShown(before))

	app1.signal(syscall.SIGTERM)
	waitDOM(t, ctx, 10*time.Second, "app1 draining", card("app1")+`.dataset.state === "draining"`)
	during := order()
	waitDOM(t, ctx, 10*time.Second, "app1's first drain step while it drains",
		card("app1")+`.dataset.state === "draining" && `+card("app1")+`.querySelector('li[data-step="readiness"]')`)
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100)) // quality 100: PNG
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	if err := os.WriteFile(shot, png, 0o644); err != nil {
		t.Fatal(err)
	}

	waitDOM(t, ctx, 20*time.Second, "app1 stopped after draining, with its drain steps through the heartbeats",
		card("app1")+`.dataset.state === "stopped" && / draining stopped$/.test(`+card("app1")+`.dataset.history) && `+
			`["readiness", "linger", "closeListener", "sseClose", "inFlight", "leaderElection", "heartbeats"].every((s) => `+
			card("app1")+`.querySelector('li[data-step="' + s + '"]'))`)
	if code := app1.wait(20 * time.Second); code != 0 {
		t.Fatalf("app1 exit code %d, want 0", code)
	}
	ended := app1.waitLog(time.Second, map[string]any{"event": "linger_ended"})["ended"]
	waitDOM(t, ctx, 10*time.Second, fmt.Sprintf("what ended app1's linger (%v) and its interrupted jobs (none)", ended),
		card("app1")+fmt.Sprintf(`.querySelector('li[data-step="linger"] .linger-ended[data-ended=%q]') && `, ended)+
			card("app1")+`.querySelector('.interrupted[data-count="0"]')`)
	waitDOM(t, ctx, 20*time.Second, "app2 ready and leader after a hand-over, serving the page and the resumed stream",
		card("app2")+`.dataset.state === "ready" && `+card("app2")+`.querySelector(".leader") && `+
			`document.querySelector("#leader").textContent === "app2" && `+
			`[...document.querySelectorAll("#handovers li")].some((li) => li.textContent.endsWith("→ app2")) && `+
			`document.querySelector("#instance").textContent === "app2" && document.querySelector("#stream").textContent.startsWith("reconnected")`)
	after := order()
	waitDOM(t, ctx, 20*time.Second, "the orders posted during and after the drain", orderShown(during)+" && "+orderShown(after))
	// No gap: every event delivered from the first one the page showed on —
	// app1's state changes and the three orders among them — is on the page,
	// although its stream moved from app1 to app2 in between.
	shown, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`[...document.querySelectorAll("#events li[data-id]")].map((li) => li.dataset.id)`))
	if err != nil || len(shown) == 0 {
		t.Fatalf("reading the feed: %v %v", shown, err)
	}
	onPage := map[string]bool{}
	for _, id := range shown {
		onPage[id] = true
	}
	rows, err := sharedPool(t, env).Query(context.Background(), `SELECT id::text FROM outbox_events
		WHERE delivery_seq >= (SELECT delivery_seq FROM outbox_events WHERE id = $1) ORDER BY delivery_seq`, shown[len(shown)-1])
	if err != nil {
		t.Fatal(err)
	}
	delivered, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range delivered {
		if !onPage[id] {
			t.Errorf("event %s was delivered but never reached the page (delivered %v, shown %v)", id, delivered, shown)
		}
	}
}
