/* mtrace's overhead benchmark: malloc + free from three call sites at stack
 * depths of about 3, 8 and 20, in one or more threads.
 *
 *   bench ITERATIONS THREADS
 *
 * Each thread runs ITERATIONS iterations, cycling through the sites, and
 * times its own loop (from the moment every thread is ready). Prints
 * "ns_per_iter X": the threads' mean loop time divided by ITERATIONS, so
 * threads that do not slow each other down keep the number of one. With
 * BENCH_FROM set (CLOCK_MONOTONIC ns), each thread times only the
 * iterations from that moment on (the clock read every 1024 iterations),
 * so that two processes started apart can be compared over the same
 * seconds, past a tracer's start. Built with -O2 -fno-omit-frame-pointer. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NOINLINE __attribute__((noinline))

void *volatile sink;
static long iterations;
static double from;
static pthread_barrier_t start;

NOINLINE void leaf(size_t size) {
    void *p = malloc(size);
    sink = p;
    free(p);
}

NOINLINE void down(int depth, size_t size) {
    if (depth <= 1)
        leaf(size);
    else
        down(depth - 1, size);
    __asm__ volatile("" ::: "memory"); /* no tail call */
}

static double now(void);

struct timed {
    double elapsed;
    long counted;
};

static void *worker(void *arg) {
    struct timed *out = arg;
    pthread_barrier_wait(&start);
    double t0 = now();
    long i0 = 0;
    int waiting = from > t0;
    for (long i = 0; i < iterations; i++) {
        if (waiting && (i & 1023) == 0 && now() >= from) {
            t0 = now();
            i0 = i;
            waiting = 0;
        }
        switch (i % 3) {
        case 0: down(1, 32); break;   /* leaf at depth ~3 below main */
        case 1: down(6, 64); break;   /* ~8 */
        default: down(18, 128); break; /* ~20 */
        }
    }
    out->elapsed = now() - t0;
    out->counted = iterations - i0;
    return NULL;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

int main(int argc, char **argv) {
    iterations = argc > 1 ? atol(argv[1]) : 200000;
    int threads = argc > 2 ? atoi(argv[2]) : 1;
    if (iterations <= 0 || threads <= 0 || threads > 64)
        return 2;
    const char *f = getenv("BENCH_FROM");
    from = f ? atof(f) : 0;
    pthread_t t[64];
    struct timed timed[64];
    pthread_barrier_init(&start, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++)
        pthread_create(&t[i], NULL, worker, &timed[i]);
    double sum = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i], NULL);
        if (timed[i].counted <= 0)
            return 3;
        sum += timed[i].elapsed / timed[i].counted;
    }
    printf("ns_per_iter %.1f\n", sum / threads);
    return 0;
}
