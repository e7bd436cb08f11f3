// Command sseload measures event-stream fan-out on one instance: it opens N
// streams on GET /api/events, reads the instance's memory with them idle,
// posts orders at a fixed rate for a while and times each order from the
// moment its POST was sent (an upper bound of its commit) to the moment each
// stream received it; then it sends SIGTERM and times the exit.
//
//	sseload -api http://127.0.0.1:18091 -pid 1234 -streams 10000 -rate 200 -duration 10s
//
// With -drain it measures what a drain does to the instance the streams
// move to (drain.go):
//
//	sseload -drain -api http://127.0.0.1:18093,http://127.0.0.1:18095 -pid 1234 -survivor-pid 1235 -streams 5000 -rate 20
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kumiko/kumiko-lifecycle-demo/scripts/internal/loadtool"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "sseload:", err)
		os.Exit(1)
	}
}

func run() error {
	api := flag.String("api", "", "base URL of the instance's API")
	pid := flag.Int("pid", 0, "process id of the instance (memory, SIGTERM)")
	streams := flag.Int("streams", 1000, "event streams to hold open")
	rate := flag.Int("rate", 200, "orders posted per second")
	duration := flag.Duration("duration", 10*time.Second, "how long orders are posted")
	linger := flag.Duration("linger", 0, "the instance's KUMIKO_LINGER, for the exit budget")
	metricsURL := flag.String("metrics", "", "the instance's /metrics: kumiko_sse_send_lag_seconds, the server's side of the latency")
	cpuProfile := flag.String("cpuprofile", "", "write this tool's own CPU profile here: it shares the cores it measures")
	drain := flag.Bool("drain", false, "measure a drain instead: streams on the first of -api (a comma-separated list), "+
		"SIGTERM -pid, clients move to the next instance after their retry hint")
	survivorPid := flag.Int("survivor-pid", 0, "with -drain: process id of the instance the clients move to (its CPU)")
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	if *drain {
		return runDrain(*api, *pid, *survivorPid, *streams, *rate)
	}
	u, err := url.Parse(*api)
	if err != nil || u.Host == "" || *pid == 0 {
		return errors.New("-api and -pid are required")
	}

	rssIdle := loadtool.RSS(*pid)
	r := newReceiver()
	conns := make([]net.Conn, 0, *streams)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	var readers sync.WaitGroup
	openStart := time.Now()
	for i := range *streams {
		c, err := openStream(u.Host)
		if err != nil {
			return fmt.Errorf("opening stream %d of %d: %w", i+1, *streams, err)
		}
		conns = append(conns, c)
		readers.Go(func() { r.read(c) })
	}
	openTook := time.Since(openStart)
	time.Sleep(time.Second) // let the instance settle before its memory is read
	rssOpen := loadtool.RSS(*pid)
	cpu0 := cpuSeconds(*pid)
	lag0 := sendLag(*metricsURL)

	posted := postOrders(*api, *rate, *duration, r)
	deadline := time.Now().Add(10 * time.Second)
	for r.received.Load() < int64(posted**streams) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	cpu := cpuSeconds(*pid) - cpu0
	lag := sendLag(*metricsURL).since(lag0)

	exitStart := time.Now()
	syscall.Kill(*pid, syscall.SIGTERM)
	for syscall.Kill(*pid, 0) == nil && time.Since(exitStart) < time.Minute {
		time.Sleep(5 * time.Millisecond)
	}
	exitTook := time.Since(exitStart)
	readers.Wait()

	p50, n := r.hist.pct(50)
	p99, _ := r.hist.pct(99)
	pmax, _ := r.hist.pct(100)
	fmt.Printf("streams %d (opened in %s)   orders %d at %d/s   deliveries %d of %d\n",
		*streams, openTook.Round(time.Millisecond), posted, *rate, n, posted**streams)
	fmt.Printf("post → stream   p50 %.1f ms   p99 %.1f ms   max %.1f ms\n", p50, p99, pmax)
	if lag.count > 0 {
		fmt.Printf("server side     p50 ≤ %s   p99 ≤ %s   from the commit to the stream's connection (%.0f writes)\n",
			lag.pct(50), lag.pct(99), lag.count)
	}
	fmt.Printf("memory          RSS %d MB idle, %d MB with the streams: %.1f KB per stream\n",
		rssIdle>>20, rssOpen>>20, float64(rssOpen-rssIdle)/1024/float64(*streams))
	fmt.Printf("CPU             %.2f s over the posting (%.0f%% of one core)\n", cpu, 100*cpu/duration.Seconds())
	fmt.Printf("SIGTERM → exit  %s (budget: linger %s + 1 s)\n", exitTook.Round(time.Millisecond), *linger)
	return nil
}

// readBuffer is what one read of a stream may take: when this side falls
// behind, a large read catches up in one system call instead of many.
const readBuffer = 16 << 10

// openStream sends the request by hand: an http.Client per stream would cost
// more memory on this side than the instance spends on its side.
func openStream(host string) (net.Conn, error) {
	c, err := net.DialTimeout("tcp", host, 5*time.Second)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(c, "GET /api/events HTTP/1.1\r\nHost: %s\r\nAccept: text/event-stream\r\n\r\n", host)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReaderSize(c, readBuffer)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusOK {
		c.Close()
		return nil, fmt.Errorf("opening the stream: %v %v", resp, err)
	}
	c.SetReadDeadline(time.Time{})
	// resp.Body undoes the chunked transfer encoding: read raw, a chunk
	// boundary inside a frame would cut its order id in two.
	return bufferedConn{Conn: c, r: resp.Body}, nil
}

type bufferedConn struct {
	net.Conn
	r io.Reader
}

func (b bufferedConn) Read(p []byte) (int, error) { return b.r.Read(p) }

// receiver matches what the streams receive with what was posted, by order
// id. It runs on the same cores as the instance, so it is made cheap: the id
// is cut out of the frame without a JSON decoder, the posted ids are an
// immutable map swapped on each post (readers take no lock), and latencies go
// to a shared histogram of atomic counters instead of a growing slice.
type receiver struct {
	mu       sync.Mutex // serialises posted's copy-on-write
	sent     atomic.Pointer[map[string]time.Time]
	hist     histogram
	received atomic.Int64
}

func newReceiver() *receiver {
	r := &receiver{}
	r.sent.Store(&map[string]time.Time{})
	return r
}

func (r *receiver) posted(id string, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	old := *r.sent.Load()
	next := make(map[string]time.Time, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	next[id] = at
	r.sent.Store(&next)
}

// payloadTotal is what precedes an order's total in its event: the public
// event carries no order id, so each order posted has a total of its own
// (postOrders), which names it here. It starts with a letter, not a quote:
// bytes.Index skips ahead on its first byte, and JSON is full of quotes (4x
// faster).
var payloadTotal = []byte(`totalCents":`)

// read counts the orders a stream receives. Every frame that arrived in one
// read is timed by that read: the frames are cut out of the read buffer
// directly, without splitting lines, so a stream costs this side about one
// read per write the instance makes.
func (r *receiver) read(c net.Conn) {
	var early []arrival
	buf := make([]byte, readBuffer)
	have := 0
	for {
		n, err := c.Read(buf[have:])
		now := time.Now()
		have += n
		// Frames end with a blank line: one cut by this read waits for the next.
		if end := bytes.LastIndex(buf[:have], []byte("\n\n")); end >= 0 {
			early = r.match(buf[:end+2], now, early)
			have = copy(buf, buf[end+2:have])
		}
		if err != nil || have == len(buf) { // the stream ended, or a frame outgrew the buffer
			break
		}
	}
	sent := *r.sent.Load()
	for _, a := range early {
		if at, ok := sent[a.id]; ok {
			r.hist.add(a.at.Sub(at))
		}
	}
}

// match times every order event in frames, received at now. Events whose
// POST has not been answered yet are returned in early, to be matched at the end.
func (r *receiver) match(frames []byte, now time.Time, early []arrival) []arrival {
	sent := *r.sent.Load()
	for {
		// The order's total, as POST answered it: "totalCents":N.
		_, rest, ok := bytes.Cut(frames, payloadTotal)
		if !ok {
			return early
		}
		end := bytes.IndexFunc(rest, func(r rune) bool { return r < '0' || r > '9' })
		if end <= 0 {
			return early
		}
		id := rest[:end]
		frames = rest[end:]
		if at, ok := sent[string(id)]; ok {
			r.hist.add(now.Sub(at))
		} else {
			// The event beat its POST's answer to this side.
			early = append(early, arrival{string(id), now})
		}
		r.received.Add(1)
	}
}

type arrival struct {
	id string
	at time.Time
}

// histogram counts latencies in 0.1 ms steps up to 100 ms, then 100 ms steps up to 100 s.
type histogram struct{ fine, coarse [1000]atomic.Int64 }

func (h *histogram) add(d time.Duration) {
	if d < 100*time.Millisecond {
		h.fine[d/(100*time.Microsecond)].Add(1)
		return
	}
	h.coarse[min(999, d/(100*time.Millisecond))].Add(1)
}

// pct is the p-th percentile in ms (the upper edge of its bucket) and the count.
func (h *histogram) pct(p float64) (float64, int64) {
	var total int64
	for i := range h.fine {
		total += h.fine[i].Load()
	}
	for i := range h.coarse {
		total += h.coarse[i].Load()
	}
	want := int64(float64(total) * p / 100)
	var n int64
	for i := range h.fine {
		if n += h.fine[i].Load(); n > want || (n == total && n > 0) {
			return float64(i+1) / 10, total
		}
	}
	for i := range h.coarse {
		if n += h.coarse[i].Load(); n > want || (n == total && n > 0) {
			return float64(i+1) * 100, total
		}
	}
	return 0, total
}

// postOrders posts at a fixed rate; order k costs k cents, and its total is
// registered with the time its POST was sent once the answer is in (a stream
// may see the event first: receiver.read matches those at the end). It
// returns how many orders were created.
func postOrders(api string, rate int, d time.Duration, r *receiver) int {
	var k atomic.Int64
	client := &http.Client{Timeout: 10 * time.Second}
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	var created atomic.Int64
	var wg sync.WaitGroup
	for {
		select {
		case <-ctx.Done():
			wg.Wait()
			return int(created.Load())
		case <-tick.C:
		}
		wg.Go(func() {
			cents := k.Add(1)
			body := fmt.Appendf(nil, `{"customer":"Ada","items":[{"sku":"tea","qty":1,"priceCents":%d}]}`, cents)
			start := time.Now()
			resp, err := client.Post(api+"/api/orders", "application/json", bytes.NewReader(body))
			if err != nil {
				return
			}
			defer resp.Body.Close()
			io.Copy(io.Discard, resp.Body) // the connection goes back to the pool
			if resp.StatusCode == http.StatusCreated {
				r.posted(strconv.FormatInt(cents, 10), start)
				created.Add(1)
			}
		})
	}
}

func cpuSeconds(pid int) float64 {
	raw, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	fields := strings.Fields(string(raw[bytes.LastIndexByte(raw, ')')+2:]))
	utime, _ := strconv.ParseFloat(fields[11], 64)
	stime, _ := strconv.ParseFloat(fields[12], 64)
	return (utime + stime) / 100 // USER_HZ is 100 on Linux
}

// lagBuckets is kumiko_sse_send_lag_seconds as scraped: cumulative counts by
// upper bound (seconds), in the order /metrics lists them.
type lagBuckets struct {
	le     []string
	counts []float64
	count  float64
}

// sendLag scrapes the instance's send-lag histogram; empty when url is.
func sendLag(url string) lagBuckets {
	var b lagBuckets
	if url == "" {
		return b
	}
	resp, err := http.Get(url)
	if err != nil {
		return b
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), `kumiko_sse_send_lag_seconds_bucket{le="`)
		if !ok {
			continue
		}
		le, value, _ := strings.Cut(rest, `"} `)
		n, _ := strconv.ParseFloat(value, 64)
		b.le, b.counts = append(b.le, le), append(b.counts, n)
		if le == "+Inf" {
			b.count = n
		}
	}
	return b
}

// since is what was observed after before was scraped.
func (b lagBuckets) since(before lagBuckets) lagBuckets {
	if len(before.counts) != len(b.counts) {
		return b
	}
	d := lagBuckets{le: b.le, count: b.count - before.count}
	for i := range b.counts {
		d.counts = append(d.counts, b.counts[i]-before.counts[i])
	}
	return d
}

// pct is the upper bound of the bucket holding the p-th percentile.
func (b lagBuckets) pct(p float64) string {
	for i, n := range b.counts {
		if n >= b.count*p/100 {
			if b.le[i] == "+Inf" {
				return "∞"
			}
			s, _ := strconv.ParseFloat(b.le[i], 64)
			return fmt.Sprintf("%g ms", s*1000)
		}
	}
	return "?"
}
