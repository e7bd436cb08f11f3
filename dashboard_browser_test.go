package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// The dashboard in a real headless browser, driven over the DevTools
// protocol: it shows state ready, then an order posted now arrives through
// the event stream. KUMIKO_SCREENSHOT=docs/dashboard.png rewrites the
// README's screenshot.
func TestDashboardInHeadlessChromium(t *testing.T) {
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
	shot := filepath.Join(t.TempDir(), "dashboard.png")
	if path := os.Getenv("KUMIKO_SCREENSHOT"); path != "" {
		shot, _ = filepath.Abs(path) // before startInProcess changes the working directory
	}
	s := startInProcess(t, fastEnv(t))

	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(browser), chromedp.NoSandbox,
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true), chromedp.WindowSize(1280, 860))
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelAlloc()
	browserCtx, cancelBrowser := chromedp.NewContext(allocCtx)
	defer cancelBrowser()
	ctx, cancel := context.WithTimeout(browserCtx, time.Minute)
	defer cancel()

	if _, err := chromedp.Run(ctx, chromedp.Navigate(apiURL(s)+"/")); err != nil {
		t.Fatalf("opening the dashboard: %v", err)
	}
	if _, err := chromedp.Run(ctx, chromedp.WaitVisible(`#state[data-state="ready"]`)); err != nil {
		t.Fatalf("the dashboard never showed state ready: %v", err)
	}
	if _, err := chromedp.Run(ctx, chromedp.WaitVisible(`#phases td`)); err != nil {
		t.Fatalf("the dashboard shows no boot timeline: %v", err)
	}
	if code, _, body := post(t, apiURL(s)+"/api/orders", validOrder, nil); code != 201 {
		t.Fatalf("POST %d %v", code, body)
	}
	if _, err := chromedp.Run(ctx, chromedp.WaitVisible(`#events li[data-type="order.created"]`)); err != nil {
		t.Fatalf("the dashboard received no order.created event: %v", err)
	}
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100)) // quality 100: PNG
	if err != nil {
		t.Fatalf("screenshot: %v", err)
	}
	if err := os.WriteFile(shot, png, 0o644); err != nil {
		t.Fatal(err)
	}
}
