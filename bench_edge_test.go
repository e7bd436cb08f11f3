package main

// The rate limiter's cost on POST /api/orders, measured, not asserted:
//
//	KUMIKO_REQUIRE_SERVICES=1 go test -run '^$' -bench 'RateLimiter' -benchtime 2000x .
//
// BenchmarkRateLimiterCostOnCreateOrder  p50 of POST /api/orders with the limiter on and off
//                                        (two in-process instances, requests alternated)
// BenchmarkRateLimiterReserve            the limiter's own cost per request (ns/op)

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

func BenchmarkRateLimiterCostOnCreateOrder(b *testing.B) {
	on, off := fastEnv(b), fastEnv(b)
	// High enough that no request is refused: the check itself is measured.
	on["KUMIKO_API_RATE_LIMIT"], on["KUMIKO_API_RATE_BURST"] = "1000000", "1000000"
	off["KUMIKO_API_RATE_LIMIT"] = "0"
	urls := []string{apiURL(startInProcess(b, on)) + "/api/orders", apiURL(startInProcess(b, off)) + "/api/orders"}
	client := &http.Client{Timeout: 5 * time.Second}
	samples := [2][]time.Duration{}
	postOnce := func(i int) {
		req, _ := http.NewRequest(http.MethodPost, urls[i], strings.NewReader(validOrder))
		req.Header.Set("Content-Type", "application/json")
		start := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			b.Fatalf("POST: %d", resp.StatusCode)
		}
		samples[i] = append(samples[i], time.Since(start))
	}
	b.ResetTimer()
	for n := range b.N {
		// Alternate which goes first, so neither always gets the warmer cache.
		postOnce(n % 2)
		postOnce(1 - n%2)
	}
	b.StopTimer()
	p50 := func(s []time.Duration) float64 {
		slices.Sort(s)
		return float64(s[len(s)/2].Microseconds()) / 1000
	}
	pOn, pOff := p50(samples[0]), p50(samples[1])
	b.ReportMetric(pOn, "limiter-on-p50-ms")
	b.ReportMetric(pOff, "limiter-off-p50-ms")
	b.ReportMetric(100*(pOn-pOff)/pOff, "cost-%")
}

func BenchmarkRateLimiterReserve(b *testing.B) {
	l := newIPRateLimiter(1_000_000, 1_000_000, maxRateLimitedIPs)
	ips := make([]string, 1000)
	for i := range ips {
		ips[i] = "10.0." + strconv.Itoa(i/256) + "." + strconv.Itoa(i%256)
	}
	now := time.Now()
	b.ResetTimer()
	for n := range b.N {
		l.reserve(ips[n%len(ips)], now)
	}
}
